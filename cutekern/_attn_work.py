"""Work list of IKBO attention: each user's query rows cut into chunks of <= block_m rows.

Built with a handful of torch ops on the device and no host sync (CUDA-graph safe): the
list has a fixed upper-bound length, unused entries carry user -1.
"""
from __future__ import annotations

import torch


def max_chunks(num_cands: int, n_seed: int, num_users: int, block_m: int) -> int:
    # a user's rows cost ceil(rows / block_m) <= rows / block_m + 1 chunks
    return -(-num_cands * n_seed // block_m) + num_users


def build_work(cand_to_user: torch.Tensor, num_users: int, n_seed: int, block_m: int,
               kv_len: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [W, 3] of (user, row_begin, row_end); rows r = b * n_seed + s. With ``kv_len``
    the chunks are ordered by their user's kv_len, longest first (stable, so a user's chunks
    stay together), unused entries last: CTAs that stride over the list then get nearly
    equal work (each takes one chunk per band of similar lengths)."""
    dev = cand_to_user.device
    b = cand_to_user.numel()
    w = max_chunks(b, n_seed, num_users, block_m)
    # c2u is non-decreasing: each user's candidates are one range; searchsorted finds it
    # without the host sync bincount would need (so this is CUDA-graph capturable)
    users = torch.arange(num_users, device=dev, dtype=cand_to_user.dtype)
    first_cand = torch.searchsorted(cand_to_user, users)
    counts = torch.searchsorted(cand_to_user, users, right=True) - first_cand
    rows = counts * n_seed
    chunks = (rows + block_m - 1) // block_m
    chunk_end = torch.cumsum(chunks, 0)
    j = torch.arange(w, device=dev)
    user = torch.searchsorted(chunk_end, j, right=True)
    valid = user < num_users
    user_c = user.clamp(max=max(num_users - 1, 0))
    local = j - (chunk_end[user_c] - chunks[user_c])
    begin = first_cand[user_c] * n_seed + local * block_m
    end = torch.minimum(begin + block_m, (first_cand[user_c] + counts[user_c]) * n_seed)
    work = torch.stack([torch.where(valid, user_c, -1), begin, end], dim=1)
    if kv_len is not None:
        cost = torch.where(valid, kv_len.to(torch.int64)[user_c], -1)
        work = work[torch.sort(cost, descending=True, stable=True).indices]
    return work.to(torch.int32)
