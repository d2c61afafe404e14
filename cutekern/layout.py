"""Broadcast layout algebra: candidate-indexed views of user tensors, never copies.

IKBO batches hold U users and B candidates; ``cand_to_user[b]`` names the user of
candidate b (non-decreasing). A "candidate view" of a user tensor ``X[U, ...]`` is
the tensor ``V[B, ...]`` with ``V[b] = X[cand_to_user[b]]``. We express it two ways:

* uniform ratio r (every user owns r candidates): V has layout
  ``((r, U), rest...) : ((0, stride_U), rest...)`` -- a stride-0 mode, a pure CuTe
  broadcast. A weight shared by every batch entry is the r = B, U = 1 case.
* general (ragged) counts: a gather mode. The batch coordinate b goes through
  ``cand_to_user`` before the user stride applies, i.e. offset(b, x) =
  cand_to_user[b] * stride_U + offset_rest(x).

The DSL half (``broadcast_mode``, ``uniform_candidate_layout``, ``gather_batch``) is
used inside kernels; the host half (``CandidateView``) is the executable model of the
same mapping that tests check against explicit torch expansion. Only the host half is
importable without the DSL.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class CandidateView:
    """Host model of a candidate view of a user tensor with element strides ``strides``
    (first stride = user stride). ``cand_to_user`` is None for a uniform ratio."""

    num_users: int
    shape_rest: tuple
    strides: tuple
    ratio: int | None = None
    cand_to_user: tuple | None = None

    @staticmethod
    def uniform(num_users: int, ratio: int, shape_rest: Sequence[int], strides: Sequence[int]):
        return CandidateView(num_users, tuple(shape_rest), tuple(strides), ratio=ratio)

    @staticmethod
    def gather(cand_to_user: Sequence[int], num_users: int, shape_rest: Sequence[int],
               strides: Sequence[int]):
        return CandidateView(num_users, tuple(shape_rest), tuple(strides),
                             cand_to_user=tuple(int(u) for u in cand_to_user))

    @property
    def num_candidates(self) -> int:
        if self.cand_to_user is not None:
            return len(self.cand_to_user)
        return self.ratio * self.num_users

    def layout(self):
        """(shape, stride) of the view as a CuTe-style hierarchical layout, or None for
        the gather case (which has no affine layout: its batch mode is an index map)."""
        if self.cand_to_user is not None:
            return None
        shape = ((self.ratio, self.num_users),) + self.shape_rest
        stride = ((0, self.strides[0]),) + tuple(self.strides[1:])
        return shape, stride

    def user_of(self, b: int) -> int:
        if self.cand_to_user is not None:
            return self.cand_to_user[b]
        return b // self.ratio

    def offset(self, b: int, coord: Sequence[int]) -> int:
        """Element offset into the user tensor of view coordinate (b, *coord)."""
        if not 0 <= b < self.num_candidates:
            raise IndexError(f"candidate {b} out of range [0, {self.num_candidates})")
        if self.cand_to_user is None:
            # evaluate the hierarchical layout: b = r + ratio * u  (colexicographic)
            (shape0, *_), (stride0, *rest_strides) = self.layout()
            r, u = b % shape0[0], b // shape0[0]
            off = r * stride0[0] + u * stride0[1]
        else:
            off = self.user_of(b) * self.strides[0]
            rest_strides = self.strides[1:]
        return off + sum(c * s for c, s in zip(coord, rest_strides))


def _dsl():
    import cutlass.cute as cute
    return cute


def broadcast_mode(t2d, batch):
    """(M, K) tensor -> (M, K, L) view whose L mode has stride 0 (a weight shared by every
    batch entry). Inside @cute.jit only."""
    cute = _dsl()
    lay = cute.make_layout((t2d.shape[0], t2d.shape[1], batch),
                           stride=(t2d.stride[0], t2d.stride[1], 0))
    return cute.make_tensor(t2d.iterator, lay)


def uniform_candidate_layout(num_users, ratio, rest_layout, user_stride):
    """Candidate view layout for a uniform ratio: ((ratio, U), rest) : ((0, sU), rest)."""
    cute = _dsl()
    bmode = cute.make_layout((ratio, num_users), stride=(0, user_stride))
    return cute.prepend(rest_layout, bmode)


def gather_batch(t_user, idx, b):
    """Slice of a (U, ...) user tensor seen by candidate b: t_user[idx[b], ...]. The
    batch mode of the candidate view is this index map; nothing is copied."""
    cute = _dsl()
    u = idx[b]
    rank = cute.rank(t_user)
    return t_user[(u,) + (None,) * (rank - 1)]
