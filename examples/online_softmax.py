"""Watch online softmax converge to the exact softmax, tile by tile (FlashAttention's core).

One query block streams over the key blocks. After each tile it keeps only a running max m and
a running sum l = sum exp(score - m); when a larger score arrives, the old sum is rescaled by
exp(m_old - m_new). After the last tile, m + log(l) is exactly logsumexp(scores), which is all
the backward pass needs to recompute every probability.

    python examples/online_softmax.py
"""

import torch

import qkv


def main() -> None:
    torch.manual_seed(0)
    q = torch.randn(1, 1, 4, 8, dtype=torch.float64)  # (B, H, L_q, D)
    k = torch.randn(1, 1, 12, 8, dtype=torch.float64)
    v = torch.randn(1, 1, 12, 8, dtype=torch.float64)
    scores = (q @ k.transpose(-1, -2)) / 8**0.5  # (1, 1, 4, 12): what the tiles never store
    exact_lse = torch.logsumexp(scores, dim=-1)[0, 0]

    steps = []
    output, lse = qkv.flash_attention(
        q, k, v, block_q=4, block_k=3, return_lse=True, trace=steps.append
    )
    print("query 0, key tiles of 3; m = running max, l = running sum of exp(score - m)")
    print(f"{'tile':>4} {'keys':>7} {'m':>8} {'l':>8} {'m + log l':>10}  exact logsumexp")
    for step in steps:
        m, l = step.running_max[0, 0, 0].item(), step.running_sum[0, 0, 0].item()
        keys = f"{3 * step.k_block}-{3 * step.k_block + 2}"
        print(
            f"{step.k_block:>4} {keys:>7} {m:8.4f} {l:8.4f} {m + torch.log(torch.tensor(l)):10.4f}"
            f"  {exact_lse[0].item():.4f}"
        )
    exact = torch.softmax(scores, dim=-1) @ v
    print(f"max |tiled - exact| output: {(output - exact).abs().max().item():.2e}")
    print(f"max |tiled - exact| lse:    {(lse[0, 0] - exact_lse).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
