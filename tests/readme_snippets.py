#!/usr/bin/env python3
"""Checks that every ```cpp block of README.md appears, line for line, in
tests/readme_snippets.cpp (which CI compiles under the strict flags).

Lines are compared with surrounding whitespace stripped; blank lines and a
README line that is only "..." (an elision) are ignored; a block's #include
lines must be among the file's own includes.

    python3 tests/readme_snippets.py README.md tests/readme_snippets.cpp
"""
import re
import sys


def significant(lines):
    out = []
    for number, line in lines:
        s = line.strip()
        if s and s != "...":
            out.append((number, s))
    return out


def main(readme_path, snippets_path):
    readme = open(readme_path, encoding="utf-8").read()
    code = [s for _, s in significant(enumerate(open(snippets_path, encoding="utf-8").read().splitlines(), 1))]
    includes = {s.split("//")[0].strip() for s in code if s.startswith("#include")}
    failures = []
    blocks = list(re.finditer(r"^[ \t]*```cpp\n(.*?)^[ \t]*```", readme, re.S | re.M))
    for block in blocks:
        first = readme.count("\n", 0, block.start(1)) + 1
        lines = significant(enumerate(block.group(1).splitlines(), first))
        for number, s in lines:
            if s.startswith("#include") and s.split("//")[0].strip() not in includes:
                failures.append(f"{readme_path}:{number}: {s.split('//')[0].strip()} is not included by {snippets_path}")
        body = [(n, s) for n, s in lines if not s.startswith("#include")]
        if not body:
            continue
        want = [s for _, s in body]
        if any(code[i:i + len(want)] == want for i in range(len(code) - len(want) + 1)):
            continue
        # Say where it departs: the longest prefix of the block found in the file.
        best = 0
        for i in range(len(code)):
            k = 0
            while k < len(want) and i + k < len(code) and code[i + k] == want[k]:
                k += 1
            best = max(best, k)
        n, s = body[min(best, len(body) - 1)]
        failures.append(f"{readme_path}:{n}: the C++ example starting at line {body[0][0]} is not in {snippets_path} "
                        f"line for line; first line not matched: {s}")
    for f in failures:
        print(f)
    if failures:
        print(f"{len(failures)} problem(s): copy the README's example into {snippets_path} (inside the context "
              "it assumes) so that CI compiles it, or fix the README.")
        return 1
    print(f"{len(blocks)} C++ examples of {readme_path} are in {snippets_path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
