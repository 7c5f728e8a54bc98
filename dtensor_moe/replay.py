"""Routing replay (Megatron's `moe_enable_routing_replay`): record every MoE layer's expert choices in one
forward, an RL rollout's say, and make later forwards on the same tokens choose exactly those experts, so that
the policy a trainer updates routes as the one that generated the samples did (GRPO collapses otherwise).

    with record_routing(model) as recorded:   # one forward (or several: microbatches, in order)
        model(tokens)
    with replay_routing(model, recorded):     # the next forwards choose the recorded experts
        loss(model(tokens)).backward()

A replayed forward skips the top-k (and the aux-free bias and group limit, which only steer it); the combine
weights are the current router's scores at the recorded experts, exactly as it weighs its own choices, so
the gate still gets its gradient. Everything downstream (capacity dropping, balance losses, the aux-free
bias counts, every expert-parallel dispatch) sees the replayed choices. Recordings are per rank (each rank's
own tokens of each forward): replay on the same mesh with the same per-rank batches. docs/routing.md,
"Routing replay".
"""

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from dtensor_moe.kernels.recompute import recomputing
from dtensor_moe.moe import MoE, named_moes

__all__ = ["RoutingReplay", "record_routing", "replay_routing"]


class RoutingReplay:
    """A recording of every MoE layer's expert choices on this rank, what `replay_routing` replays.

    `record_routing` fills one; a rollout engine's choices (vLLM's, say) can be handed in directly.
    Replaying never consumes it: the same recording replays again (several optimizer epochs over one
    rollout).

    Args:
        experts (Mapping[str, Sequence[Tensor]] | None): for the MoE layer at qualified name `name` in the
            model, `experts[name]` lists one int64 experts_TK [tokens, top_k] per recorded forward, in
            forward order (copied into the `experts` attribute, a dict of lists). Default None (empty).
        num_experts (Mapping[str, int] | None): each recorded layer's expert count, checked against the
            replaying layer's (ids of a 4-expert layer are valid ids of an 8-expert one: without it that mix-up
            would replay silently). `record_routing` fills it. Default None (unchecked).

    Example:
        >>> import torch
        >>> from dtensor_moe import RoutingReplay
        >>> recorded = RoutingReplay({"layers.0.moe": [torch.tensor([[0, 1], [2, 3]])]})
        >>> len(recorded.experts["layers.0.moe"])
        1
    """

    def __init__(self, experts: Mapping[str, Sequence[torch.Tensor]] | None = None,
                 num_experts: Mapping[str, int] | None = None):
        if experts is not None and not isinstance(experts, Mapping):
            raise TypeError(f"RoutingReplay(experts) takes a mapping of MoE layer name -> list of int64 experts_TK "
                            f"tensors, got {type(experts).__name__}")
        for name, v in (experts or {}).items():
            if isinstance(v, torch.Tensor) or not all(isinstance(t, torch.Tensor) for t in v):
                got = type(v).__name__ if isinstance(v, torch.Tensor) else sorted({type(t).__name__ for t in v})
                raise TypeError(f"RoutingReplay(experts)[{name!r}] must be a list of int64 experts_TK tensors (one "
                                f"per recorded forward), got {got}")
        self.experts: dict[str, list[torch.Tensor]] = {name: list(v) for name, v in (experts or {}).items()}
        self.num_experts: dict[str, int] = dict(num_experts or {})


class LayerReplay:
    """One layer's side of a recording or a replay, its `moe.routing_replay` for the context's duration.

    Hooks on the layer's parent module (the layer itself at the root) keep the position in the recording: the
    pre-hook sets `current`, the entry this forward replays, and the hook appends `chosen`, what it chose, to
    the recording. The layer's forward only reads `current` and writes `chosen`, so compiled code never sees the
    position: the main job's compiled blocks and parallelize_moe(compile=...)'s compiled layer forward, both
    inside those hooks, compile one graph for every microbatch (traced, the position would be a guard, and
    fullgraph compilation fails past the recompile limit). A recomputation (eager activation checkpointing: it
    runs inside backward, maybe without its parent's hooks) replays in the layer's forward instead.

    A recording that does not fit the forward (another token count, a forward it lacks) on one rank of the layer's
    expert-parallel group raises the same ValueError on all of them: an eager replayed forward agrees on it with
    one small all-reduce over the group before its dispatch, the first collective that would otherwise hang or die
    on the ranks that found nothing wrong."""

    def __init__(self, name: str, entries: list[torch.Tensor], replaying: bool, moe: MoE | None = None):
        self.name, self.entries, self.replaying, self.moe = name, entries, replaying, moe
        self.missing: str | None = None  # why this forward has no entry to replay (raised once the group agrees)
        self.current: torch.Tensor | None = None  # the experts_TK the running forward replays
        self.chosen: torch.Tensor | None = None  # the experts_TK the running forward chose
        self.position = 0  # the entry the next forward replays
        # Entries replayed by forwards that built a graph, oldest first: activation checkpointing recomputes each
        # such forward once, inside its backward, and backward takes microbatches in forward order (gradient
        # accumulation, every torch.distributed.pipelining schedule), so a recomputation replays the oldest.
        self.awaiting_recompute: list[torch.Tensor] = []

    def before(self, parent: nn.Module, args):
        if not self.replaying or recomputing():
            return
        i = self.position
        if i >= len(self.entries):
            missing = (f"routing replay: MoE layer {self.name!r} has {len(self.entries)} recorded forward(s); this "
                       f"is forward {i + 1} of the replay (one recorded forward per replayed one: record every "
                       "microbatch, in the order the replay runs them)")
            if not self._groups():
                raise ValueError(missing)
            # The layer's forward says so, on every rank of its group at once (replayed, _agree).
            self.position, self.current, self.missing = i + 1, None, missing
            return
        self.position, self.current, self.missing = i + 1, self.entries[i], None
        if torch.is_grad_enabled():
            self.awaiting_recompute.append(self.current)

    def after(self, parent: nn.Module, args, output):
        if recomputing():  # it chose again what its forward recorded
            return
        if not self.replaying:
            if self.chosen is None:
                raise ValueError(f"record_routing: MoE layer {self.name!r} did not run in its parent's forward; "
                                 "record and replay follow each layer's parent module's forwards")
            self.entries.append(self.chosen.detach())
        self.current = self.chosen = None

    def replayed(self, num_tokens: int, recomputation: bool) -> torch.Tensor | None:
        """The layer forward's experts_TK to replay (None while recording), its token count checked."""
        if not self.replaying:
            return None
        if recomputation:
            if not self.awaiting_recompute:
                raise ValueError(f"routing replay: MoE layer {self.name!r} is recomputed (activation checkpointing) "
                                 "but no replayed forward awaits its recomputation")
            self.current = self.awaiting_recompute.pop(0)
        error = None  # (code, message): _CODES
        if self.missing is not None:
            error = (1, self.missing)
        elif self.current is None:
            error = (2, f"routing replay: MoE layer {self.name!r} ran outside its parent module's forward; "
                        "record and replay follow each layer's parent module's forwards")
        elif self.current.shape[0] != num_tokens:
            error = (3, f"routing replay: MoE layer {self.name!r}, replayed forward {self.position} has "
                        f"{num_tokens} tokens on this rank but its recording has {self.current.shape[0]} "
                        f"(experts_TK of shape {tuple(self.current.shape)}); replay the recorded tokens, on the "
                        "recording's mesh")
        if recomputation:  # inside backward, in the order every rank's forwards ran: nothing to agree on
            if error:
                raise ValueError(error[1])
        else:
            self._agree(error, num_tokens)
        self.missing = None
        return self.current

    def _groups(self) -> list:
        """The process groups this layer's forward exchanges tokens over (its EP and ETP groups of more than one
        rank), the first collective after the replay's checks; [] for a layer without a dispatch."""
        hooks = getattr(getattr(self.moe, "experts", None), "expert_parallel", None)
        if hooks is None or not dist.is_initialized():
            return []
        g = hooks.dispatcher.group
        return [x for x in (g.ep_group, g.etp_group) if dist.get_world_size(x) > 1]

    def _agree(self, error: tuple[int, str] | None, num_tokens: int) -> None:
        """Raises on every rank of the layer's group if the replay does not fit on any of them: one all-reduce
        (MAX) of a [world, 3] table (code, tokens, recorded tokens) per group, eagerly; compiled code (the
        main job's compiled blocks) raises on the rank that found it, as does a layer without a dispatch."""
        groups = [] if torch.compiler.is_compiling() else self._groups()
        if not groups:
            if error:
                raise ValueError(error[1])
            return
        device = next(self.moe.parameters()).device
        table = torch.zeros(dist.get_world_size(), 3, dtype=torch.int64, device=device)
        if error:
            recorded = len(self.entries) if error[0] == 1 else (
                self.current.shape[0] if self.current is not None else 0)
            table[dist.get_rank()] = torch.tensor([error[0], num_tokens, recorded])
        for g in groups:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=g)
        rows = table.tolist()
        bad = [(rank, row) for rank, row in enumerate(rows) if row[0]]
        if not bad:
            return
        what = "; ".join(f"rank {rank}: " + _CODES[code].format(tokens=tokens, recorded=recorded,
                                                                 forward=self.position)
                         for rank, (code, tokens, recorded) in bad)
        summary = (f"routing replay: MoE layer {self.name!r}, replayed forward {self.position} does not match the "
                   f"recording on rank(s) {[rank for rank, _ in bad]} of its expert-parallel group ({what}); every "
                   "rank of the group stops here, before the dispatch; replay the recorded tokens on the recording's "
                   "mesh, one recorded forward per replayed one")
        self.current = self.missing = None
        raise ValueError(f"{error[1]}. {summary}" if error else summary)


# What _agree's codes say about a rank's forward.
_CODES = {
    1: "no recorded forward {forward} ({recorded} recorded)",
    2: "the layer ran outside its parent module's forward",
    3: "{tokens} tokens, its recording {recorded}",
}


@contextmanager
def record_routing(model: nn.Module, into: RoutingReplay | None = None) -> Iterator[RoutingReplay]:
    """Context manager recording routing: inside, each forward of each MoE layer of `model` appends its
    choices (this rank's tokens) to the yielded `RoutingReplay`. Any mode: eval and no-grad forwards
    record too.

    Args:
        model (nn.Module): the model whose `MoE` layers record (named by their qualified names in it).
        into (RoutingReplay | None): a recording to append to; None (default) starts a new one.

    Returns:
        Iterator[RoutingReplay]: yields the recording (`into`, else the new one), filled as the forwards run.

    Example:
        >>> import torch
        >>> from dtensor_moe import MoE, MoEConfig, record_routing, replay_routing
        >>> moe = MoE(MoEConfig(dim=8, hidden_dim=16, num_experts=4, top_k=2))
        >>> x_BLD = torch.randn(2, 3, 8)
        >>> with record_routing(moe) as recorded:
        ...     y_BLD = moe(x_BLD)
        >>> recorded.experts[""][0].shape  # the root module's name is ""
        torch.Size([6, 2])
    """
    recorded = RoutingReplay() if into is None else into
    layers = named_moes(model)
    if not layers:
        raise ValueError(f"record_routing: {type(model).__name__} has no MoE layer (dtensor_moe.MoE) to record; "
                         "valid: a model holding MoE layers (an empty recording would replay nothing)")
    for name, moe in layers.items():
        if recorded.num_experts.setdefault(name, moe.config.num_experts) != moe.config.num_experts:
            raise ValueError(f"record_routing: MoE layer {name!r} has {moe.config.num_experts} experts, `into` holds "
                             f"a recording of {recorded.num_experts[name]} for it; valid: a new recording")
    with _attached(model, layers, {n: LayerReplay(n, recorded.experts.setdefault(n, []), False) for n in layers}):
        yield recorded


@contextmanager
def replay_routing(model: nn.Module, recorded: RoutingReplay) -> Iterator[None]:
    """Context manager replaying routing: inside, the k-th forward of each MoE layer of `model` chooses the
    experts of that layer's k-th recorded forward (its combine weights are the current router's scores at
    them, so the gate still gets its gradient).

    Every check that needs no forward runs on entry, before any collective; a forward whose token count
    differs from its recording's, or that the recording lacks, raises ValueError, on every rank of the layer's
    expert-parallel group alike when an eager forward finds it on one of them (one small all-reduce before the
    dispatch; the message names the ranks). Replay on the recording's mesh with the same per-rank batches
    (docs/routing.md, "Routing replay").

    Args:
        model (nn.Module): the model that recorded (the same MoE layer names).
        recorded (RoutingReplay): the recording, e.g. from `record_routing`; it is not consumed.

    Returns:
        Iterator[None]: a context manager; nothing is yielded.

    Raises:
        TypeError: `recorded` is not a RoutingReplay.
        ValueError: the model has no MoE layer, a layer has no recording or the recording names layers
            the model lacks, or a recorded experts_TK has the wrong shape, dtype or expert ids.

    Example (an RL step: the rollout's choices, recorded without gradients, replayed in training)::

        with torch.no_grad(), record_routing(model) as rollout:
            samples = generate(model, prompts)
        with replay_routing(model, rollout):
            loss_fn(model(samples)).backward()
    """
    if not isinstance(recorded, RoutingReplay):
        hint = " (wrap it: RoutingReplay(your_dict))" if isinstance(recorded, Mapping) else ""
        raise TypeError(f"replay_routing(model, recorded): recorded must be a RoutingReplay, e.g. from "
                        f"record_routing, got {type(recorded).__name__}{hint}")
    layers = named_moes(model)
    _check(layers, recorded)
    with _attached(model, layers, {n: LayerReplay(n, recorded.experts[n], True, moe) for n, moe in layers.items()}):
        yield


def _check(layers: dict[str, MoE], recorded: RoutingReplay):
    if not layers:
        raise ValueError("replay_routing: the model has no MoE layer")
    empty = [n for n in layers if not recorded.experts.get(n)]
    if empty:
        raise ValueError(f"replay_routing: nothing recorded for MoE layer(s) {empty} (recorded: "
                         f"{sorted(n for n, v in recorded.experts.items() if v)}); record them first, in "
                         "`with record_routing(model) as recorded:`, on this model")
    unknown = sorted(set(recorded.experts) - set(layers))
    if unknown:
        raise ValueError(f"replay_routing: recorded layers {unknown} are not MoE layers of the model "
                         f"(its MoE layers: {sorted(layers)}); replay on the model that recorded")
    for name, moe in layers.items():
        E, K = moe.config.num_experts, moe.config.top_k
        if recorded.num_experts.get(name, E) != E:
            raise ValueError(f"replay_routing: MoE layer {name!r} has {E} experts, its recording was made by a layer "
                             f"of {recorded.num_experts[name]}; valid: replay on the model that recorded (its layer of "
                             f"{recorded.num_experts[name]} experts)")
        for i, experts_TK in enumerate(recorded.experts[name]):
            where = f"replay_routing: MoE layer {name!r}, recorded forward {i + 1}"
            if experts_TK.dim() != 2 or experts_TK.shape[1] != K or experts_TK.dtype != torch.int64:
                raise ValueError(f"{where}: experts_TK must be int64 of shape [tokens, top_k={K}], got "
                                 f"{experts_TK.dtype} of shape {tuple(experts_TK.shape)}")
            if experts_TK.numel() and not (0 <= experts_TK.min() and experts_TK.max() < E):
                raise ValueError(f"{where}: expert ids must be in 0..{E - 1}, got {experts_TK.min().item()}.."
                                 f"{experts_TK.max().item()}")
            if K > 1 and (experts_TK.sort(dim=1).values.diff(dim=1) == 0).any():
                raise ValueError(f"{where}: a token chooses one expert twice; each token's {K} experts must differ")


@contextmanager
def _attached(root: nn.Module, layers: dict[str, MoE], replays: dict[str, LayerReplay]):
    busy = [n for n, m in layers.items() if m.routing_replay is not None]
    if busy:
        raise ValueError(f"MoE layer(s) {busy} are already recording or replaying their routing; "
                         "close that context first (record and replay do not nest)")
    handles = []
    try:
        for name, moe in layers.items():
            moe.routing_replay = replays[name]
            parent = root.get_submodule(name.rpartition(".")[0]) if name else moe
            # First: its checks run before the parent's own hooks (FSDP's all-gather), so before any collective.
            handles += [parent.register_forward_pre_hook(replays[name].before, prepend=True),
                        parent.register_forward_hook(replays[name].after)]
        yield
    finally:
        for handle in handles:
            handle.remove()
        for moe in layers.values():
            moe.routing_replay = None
