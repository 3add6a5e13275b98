"""Finds a test file that compiles only inside the CI's unity batches.

The CI builds perf_tests from a few unity translation units (PERF_TESTS_UNITY, to save its 2 cores), while a
machine with many cores compiles each test file alone (scripts/gpu-check.sh). A file that uses, unqualified, a
name that only another file declares at file scope (`using test_util::TempDir;`, `using P = ...;`, a helper
struct or class) compiles in a batch after that file and fails alone: it cost a GPU session's build
once. This check reads the files instead of compiling each alone (15-20 s of CPU each here).

    python tests/unity_names_check.py tests/test_*.cpp
"""
import re
import sys
from pathlib import Path

# File-scope declarations (column 0: this project's style indents everything inside functions and classes,
# and not the contents of namespaces). Functions are left out: too many shapes to read without a compiler.
USING = re.compile(r"^using\s+(?:[\w:]+::)(\w+)\s*;", re.M)
ALIAS = re.compile(r"^using\s+(\w+)\s*=", re.M)
TYPE = re.compile(r"^(?:template\s*<[^;{]*>\s*)?(?:struct|class|enum(?:\s+class)?)\s+(\w+)\s*(?:final\s*)?(?:\{|:(?!:))",
                  re.M)
CODE_NOISE = re.compile(r'//[^\n]*|/\*.*?\*/|R"(\w*)\(.*?\)\1"|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def declared(text: str) -> set:
    names = set()
    for pattern in (USING, ALIAS, TYPE):
        names.update(pattern.findall(text))
    return names


def declares(text: str, name: str) -> bool:
    """Whether `text` declares `name` itself, at any depth: a using-declaration or alias, a type or template
    parameter, or a function at file scope (`double max_diff(...)`)."""
    n = re.escape(name)
    return re.search(rf"\b(?:using\s+(?:[\w:]+::)?|struct\s+|class\s+|enum\s+|typename\s+){n}\b"
                     rf"|^[\w:<>,\s*&]*[\w>][\s*&]+{n}\s*\(", text, re.M) is not None


def uses(text: str, name: str) -> bool:
    """`name` used unqualified: not after ::, ., -> or inside a longer identifier."""
    return re.search(rf"(?<![\w:.>]){re.escape(name)}\b", text) is not None


def main(paths: list) -> int:
    code = {p: CODE_NOISE.sub(" ", Path(p).read_text()) for p in paths}
    own = {p: declared(text) for p, text in code.items()}
    problems = []
    for p, text in code.items():
        for q in paths:
            if q == p:
                continue
            for name in sorted(own[q] - own[p]):
                if uses(text, name) and not declares(text, name):
                    problems.append(f"{p}: uses {name}, which only {q} declares at file scope "
                                    f"(compiles in a unity batch after it, not alone): qualify it or declare it here")
    for line in problems:
        print(line)
    if not problems:
        print(f"unity names: {len(paths)} files, each compiles alone as far as its file-scope names go")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
