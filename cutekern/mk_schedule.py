"""The decode megakernel's offline schedule (../shared/specs/megakernel.md; plan in
kernels/CONTRACT_MEGAKERNEL.md): the task DAG of one Qwen3 decode step, a static list
schedule of it over the persistent CTAs, and the validator every schedule must pass before a
kernel may run it. No kernel yet: the schedule is fixed here first.

A task is one CTA's unit of work (a 128-output tile of a linear layer with its fused norm /
activation, or one KV head's attention); it may start once every task it depends on has
finished, which the kernel will learn from per-task completion flags stamped with the decode
step (epoch counters: no re-zeroing between tokens). Each CTA runs its list in order, so a
schedule deadlocks if some CTA waits on a task that can never finish first; `validate` runs
the lists to completion (or names the stuck CTA and what it waits for).
"""
from __future__ import annotations

from dataclasses import dataclass

from .reference import Qwen3Config, w4a16_bytes

TILE = 128   # outputs per linear task (one head of q / k / v)


@dataclass(frozen=True)
class Task:
    name: str
    kind: str           # qkv, attn, o, gateup, down, head
    layer: int          # -1 for the LM head
    deps: tuple         # names of the tasks it waits for
    weight_bytes: int   # what it streams (its cost in a memory-bound step)


class ScheduleError(ValueError):
    pass


def decode_dag(cfg: Qwen3Config, *, quant_head=False):
    """The tasks of one decode step in a topological order. Linear tiles fuse what they
    need of the vector before them (the RMSNorm of the residual, SiLU(gate) * up), so a
    linear tile waits for every tile of the layer before it; attention of KV head h waits
    only for the q tiles of its q heads and its own k and v tiles."""
    d, hq, hk, hd, f = cfg.hidden, cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.intermediate
    if hd != TILE or d % TILE or f % TILE or hq % hk:
        raise ValueError(f"decode_dag: needs head_dim == {TILE} and hidden / intermediate "
                         f"multiples of it, got {cfg}")
    tasks, prev = [], ()
    for layer in range(cfg.layers):
        qkv = [Task(f"L{layer}.qkv{t}", "qkv", layer, prev, w4a16_bytes(TILE * d))
               for t in range(hq + 2 * hk)]
        rep = hq // hk
        attn = [Task(f"L{layer}.attn{h}", "attn", layer,
                     tuple(qkv[j].name for j in range(h * rep, (h + 1) * rep))
                     + (qkv[hq + h].name, qkv[hq + hk + h].name), 0) for h in range(hk)]
        o = [Task(f"L{layer}.o{t}", "o", layer, tuple(a.name for a in attn),
                  w4a16_bytes(TILE * hq * hd)) for t in range(d // TILE)]
        gu = [Task(f"L{layer}.gateup{t}", "gateup", layer, tuple(x.name for x in o),
                   2 * w4a16_bytes(TILE * d)) for t in range(f // TILE)]
        down = [Task(f"L{layer}.down{t}", "down", layer, tuple(x.name for x in gu),
                     w4a16_bytes(TILE * f)) for t in range(d // TILE)]
        tasks += qkv + attn + o + gu + down
        prev = tuple(x.name for x in down)
    head_bytes = w4a16_bytes(TILE * d) if quant_head else TILE * d * 2
    tasks += [Task(f"head{t}", "head", -1, prev, head_bytes) for t in range(-(-cfg.vocab // TILE))]
    return tasks


def list_schedule(tasks, num_ctas, *, bytes_per_us=4.3e6 / 132, sync_us=1.0, prefetch=True,
                  tail_us=0.5):
    """A static list schedule: tasks in the DAG's order, each on the CTA where it finishes
    earliest (ties to the lower CTA). Cost model: a task streams its weights at one SM's
    share of the copy rate; with `prefetch` (the spec's loader that never waits on
    activations) the stream starts when the CTA is free and the task ends `tail_us` after
    its inputs are ready (its dependencies' finish plus `sync_us` for a flag seen across
    CTAs) or when its weights are in, whichever is later; without it the stream starts only
    once the inputs are ready. Returns (lists: the task names of each CTA in order, the
    estimated step time in us)."""
    free = [0.0] * num_ctas
    finish = {}
    lists = [[] for _ in range(num_ctas)]

    def end(ready, at, load):
        return max(at + load, ready + tail_us) if prefetch else max(ready, at) + load

    for t in tasks:
        ready = max((finish[d] + sync_us for d in t.deps), default=0.0)
        load = max(t.weight_bytes / bytes_per_us, 0.2)
        c = min(range(num_ctas), key=lambda i: (end(ready, free[i], load), i))
        finish[t.name] = free[c] = end(ready, free[c], load)
        lists[c].append(t.name)
    return lists, max(finish.values(), default=0.0)


def validate(tasks, lists, *, max_ctas):
    """Raise ScheduleError unless the per-CTA lists can run: at most `max_ctas` lists (all
    co-resident), every task exactly once, dependencies known and acyclic, and running the
    lists in order finishes every task (no CTA waits forever). Returns the number of rounds
    the in-order run took (a rough depth of the schedule)."""
    if len(lists) > max_ctas:
        raise ScheduleError(f"{len(lists)} CTAs but only {max_ctas} can be co-resident")
    names = [n for lst in lists for n in lst]
    by_name = {t.name: t for t in tasks}
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})[:3]
        raise ScheduleError(f"tasks scheduled twice: {dup}")
    missing = set(by_name) - set(names)
    if missing:
        raise ScheduleError(f"tasks not scheduled: {sorted(missing)[:3]}")
    unknown = set(names) - set(by_name)
    if unknown:
        raise ScheduleError(f"unknown tasks in the lists: {sorted(unknown)[:3]}")
    for t in tasks:
        bad = [d for d in t.deps if d not in by_name]
        if bad:
            raise ScheduleError(f"{t.name} waits for unknown tasks {bad[:3]}")
    done, pos, rounds = set(), [0] * len(lists), 0
    while len(done) < len(names):
        progressed = False
        rounds += 1
        for c, lst in enumerate(lists):
            while pos[c] < len(lst) and all(d in done for d in by_name[lst[pos[c]]].deps):
                done.add(lst[pos[c]])
                pos[c] += 1
                progressed = True
        if not progressed:
            c = next(c for c, lst in enumerate(lists) if pos[c] < len(lst))
            t = by_name[lists[c][pos[c]]]
            waits = [d for d in t.deps if d not in done]
            raise ScheduleError(f"deadlock: CTA {c} waits at {t.name} for {waits[:3]} "
                                f"(a cycle, or a CTA list out of dependency order)")
    return rounds
