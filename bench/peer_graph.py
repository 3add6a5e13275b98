"""Python peer of bench_graph.cpp: eager vs torch.compile(mode="reduce-overhead")
on the same 6-layer MLP (batch 32) and transformer encoder block (d=256, 4 heads,
feed-forward 1024, seq 64), same session, CUDA events, medians.
Run: python bench/peer_graph.py [--iters 200] (needs a GPU)."""
import argparse

import torch
from cuda_timing import median_ms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=512)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("peer_graph: no CUDA device")
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width)]
    for _ in range(5):
        layers += [torch.nn.ReLU(), torch.nn.Linear(args.width, args.width)]
    mlp = torch.nn.Sequential(*layers).cuda().eval()
    x = torch.randn(args.batch, args.width, device="cuda")
    compiled = torch.compile(mlp, mode="reduce-overhead")
    with torch.no_grad():
        eager = median_ms(lambda: mlp(x), 20, args.iters)
        comp = median_ms(lambda: compiled(x), 20, args.iters)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    print(f"MLP inference eager: {eager:.4f} ms, torch.compile(reduce-overhead): {comp:.4f} ms, "
          f"ratio {eager / comp:.2f}x")
    # Same block as bench_graph.cpp: LibTorch's TransformerEncoderLayer is (S, N, E), post-norm, ReLU.
    block = torch.nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024).cuda().eval()
    seq = torch.randn(64, args.batch, 256, device="cuda")
    compiled_block = torch.compile(block, mode="reduce-overhead")
    with torch.no_grad():
        eager = median_ms(lambda: block(seq), 20, args.iters)
        comp = median_ms(lambda: compiled_block(seq), 20, args.iters)
    print(f"Transformer block inference eager: {eager:.4f} ms, torch.compile(reduce-overhead): {comp:.4f} ms, "
          f"ratio {eager / comp:.2f}x")


if __name__ == "__main__":
    main()
