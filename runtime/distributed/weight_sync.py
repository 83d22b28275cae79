"""Weight-update groups: a process group that an RL trainer (rank 0) and every rank of
this engine join, so that the trainer broadcasts new weights straight into the model
(SGLang's `/init_weights_update_group`, `/update_weights_from_distributed`,
`/destroy_weights_update_group`).

Joining (`join`): the trainer hosts a TCP store at `master_address:master_port`; each
engine rank connects as a client and creates a gloo (CPU) or NCCL (CUDA) group over it,
under the keys `torch.distributed`'s own group creation uses for a group named
`group_name` on the first device of the backend (the `init_custom_process_group` helper
of SGLang and the RL frameworks builds exactly this, so their trainers meet it
unchanged). A join waits at most `JOIN_TIMEOUT_S`; a receive at most `RECEIVE_TIMEOUT_S`.
Nothing here is pickled: tensors cross the group, names, dtypes and shapes come as JSON.

Under tensor parallelism every rank joins (rank `rank_offset + tp_rank`) and receives
every tensor whole, keeping its own slice (`checkpoint_index`, as the checkpoint loader
does). Rank 0 checks each request and announces it to the other ranks over the control
group before anything is joined or received; the ranks then agree (`TPGroup.all_agree`)
on the outcome, so every rank has joined, or none; has the new weights, or none.

A trainer broadcasts while its request is answered (it cannot wait for the answer: the
update ends only once the tensors arrived), so an update refused by the model's checks
(a name the model lacks, a shape it does not have, a quantized model) still receives
every tensor over the joined group and drops it (`drain`): the trainer's broadcast ends
and it reads the refusal, instead of waiting for receivers that never come. A tensor is
drained only if it is at most `DRAIN_FACTOR` times the model's largest weight; a request
naming a group not joined, or a larger tensor, is refused with nothing received.
"""

from __future__ import annotations

import datetime
import logging
import math
from collections.abc import Callable
from dataclasses import asdict
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from sprig.runtime.distributed.group import TPGroup
from sprig.runtime.model_config import ModelConfig
from sprig.runtime.models import model_class
from sprig.runtime.weight_loader import checkpoint_target, load_named_tensors, named_tensor
from sprig.runtime.weight_update import BroadcastPlan, GroupSpec, WeightUpdateError, dtype_name

log = logging.getLogger("sprig.weights")
JOIN_TIMEOUT_S = 120.0  # the most joining a group waits for the trainer and the other members
RECEIVE_TIMEOUT_S = 600.0  # the most one broadcast waits for the trainer to send
MAX_WEIGHT_GROUPS = 4  # groups joined at once
DRAIN_FACTOR = 2  # a refused update's tensors are received and dropped up to this many times the largest weight
Announce = Callable[[str, dict], None]  # rank 0: (kind, JSON args) to the other tensor-parallel ranks


def join(spec: GroupSpec, rank: int, *, timeout_s: float = JOIN_TIMEOUT_S) -> dist.ProcessGroup:
    """Join `spec`'s group as `rank` (0 hosts the store: the trainer's side, which a trainer
    may call too). Blocks until every member has joined; raises after `timeout_s` seconds."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(spec.master_address, spec.master_port, spec.world_size, rank == 0, timeout=timeout)
    name = spec.group_name
    prefixed = dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store))
    if spec.backend == "gloo":
        return dist.ProcessGroupGloo(dist.PrefixStore("cpu/", prefixed), rank, spec.world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = datetime.timedelta(seconds=RECEIVE_TIMEOUT_S)
    return dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", prefixed), rank, spec.world_size, options)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float = RECEIVE_TIMEOUT_S) -> None:
    """Rank 0's `tensor` into every member's `tensor` (same shape and dtype), in place."""
    options = dist.BroadcastOptions()
    options.rootRank, options.timeout = 0, datetime.timedelta(seconds=timeout_s)
    group.broadcast([tensor], options).wait()


class WeightGroups:
    """One rank's weight-update groups, by name (at most `MAX_WEIGHT_GROUPS`), and the
    updates received over them into `model` (float weights only). The leading rank (the
    only one, or rank 0 of `tp`) checks each call before anything is joined or received,
    and `announce`s it to the other tensor-parallel ranks, which make the same call; every
    rank makes the calls in the same order. Joins wait at most `join_timeout_s`."""

    def __init__(self, model: nn.Module, config: ModelConfig, device: torch.device, *, quantized: bool,
                 tp: TPGroup | None = None, announce: Announce | None = None) -> None:
        self.model, self.config, self.device, self.quantized = model, config, device, quantized
        self.tp, self.announce = tp, announce
        self.groups: dict[str, tuple[GroupSpec, dist.ProcessGroup]] = {}
        self.join_timeout_s = JOIN_TIMEOUT_S
        self._leads = tp is None or tp.rank == 0
        self._whole: nn.Module | None = None  # the unsplit model on the meta device: checkpoint shapes

    # ------------------------------------------------------------------ joining
    def check_join(self, spec: GroupSpec) -> None:
        """ValueError saying why `spec` cannot be joined (checked before anything is)."""
        spec.check_ranks(1 if self.tp is None else self.tp.size)
        if spec.group_name in self.groups:
            raise ValueError(f"group_name {spec.group_name!r} is joined already (destroy it first)")
        if len(self.groups) >= MAX_WEIGHT_GROUPS:
            raise ValueError(f"{MAX_WEIGHT_GROUPS} weight-update groups are joined already (destroy one first)")
        if spec.backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"backend 'nccl' needs a CUDA device; the model runs on {self.device} (use 'gloo')")

    def join(self, spec: GroupSpec) -> str:
        """Join `spec`'s group on every rank, or on none: ValueError saying why."""
        if self._leads:
            self.check_join(spec)
        if self.announce is not None:
            self.announce("join", asdict(spec))
        group, error = None, None
        try:
            group = join(spec, spec.rank_offset + self._rank, timeout_s=self.join_timeout_s)
        except Exception as e:  # the trainer did not come, or the address is wrong: nothing is kept
            error = e
        if not self._agree(error is None):
            if group is not None:
                _shut(group)
            reason = error or "another tensor-parallel rank could not join"
            raise ValueError(f"could not join weight-update group {spec.group_name!r} at "
                             f"{spec.master_address}:{spec.master_port}: {reason}")
        self.groups[spec.group_name] = (spec, group)
        log.info("joined weight-update group %r as rank %d of %d (%s)", spec.group_name,
                 spec.rank_offset + self._rank, spec.world_size, spec.backend)
        return f"Succeeded to initialize weight-update group {spec.group_name!r}."

    def leave(self, name: str) -> str:
        """Leave group `name` on every rank; ValueError if none is joined by that name."""
        if self._leads and name not in self.groups:
            raise ValueError(f"group_name {name!r}: no weight-update group of that name is joined")
        if self.announce is not None:
            self.announce("leave", {"group_name": name})
        _, group = self.groups.pop(name)
        _shut(group)
        log.info("left weight-update group %r", name)
        return f"Succeeded to destroy weight-update group {name!r}."

    def close(self) -> None:
        """Leave every group (this rank only: the process is stopping)."""
        for _, group in self.groups.values():
            _shut(group)
        self.groups.clear()

    # ------------------------------------------------------------------ updating
    def check_update(self, plan: BroadcastPlan) -> None:
        """ValueError naming the first thing wrong with `plan`, checked before anything is
        received: the group, and each tensor's name (a float weight of the model, named
        once) and shape (the whole checkpoint tensor's, also under tensor parallelism)."""
        if plan.group_name not in self.groups:
            raise ValueError(f"group_name {plan.group_name!r}: no weight-update group of that name is joined "
                             "(/init_weights_update_group first)")
        if self.quantized:
            raise ValueError("the served model has quantized layers, whose codes a broadcast tensor cannot replace "
                             "(update from a checkpoint on disk)")
        whole = self._whole_model()
        seen: set[str] = set()
        for name, shape in zip(plan.names, plan.shapes, strict=True):
            if name in seen:
                raise ValueError(f"names: {name!r} is given twice")
            seen.add(name)
            try:
                expected = tuple(named_tensor(whole, name).shape)
            except ValueError as e:
                raise ValueError(f"names: {e}") from None
            if tuple(shape) != expected:
                raise ValueError(f"shapes: {name!r} has shape {list(shape)}, the model expects {list(expected)}")
        if self.tp is not None and getattr(self.model, "split_checkpoint_modules", ()):
            raise ValueError(f"{self.config.architecture}: weights split over tensor-parallel ranks are updated from "
                             "a checkpoint on disk")
        metas = [(n, torch.empty(s, device="meta")) for n, s in zip(plan.names, plan.shapes, strict=True)]
        load_named_tensors(whole, metas)  # two names of one weight: a ValueError, nothing allocated

    def update(self, plan: BroadcastPlan) -> int:
        """Receive every tensor of `plan` from the trainer, in order, then copy each (this
        rank's slice of it) into the model; returns how many weights changed. All tensors
        arrive before any is copied, and every rank copies, or none does: on failure
        `WeightUpdateError` says why, with the old weights in place. Holds the received
        tensors (this rank's slices) until then. A plan `check_update` refuses is a
        ValueError saying why, after its tensors were received and dropped where `drain`
        can take them (nothing else changes)."""
        if self._leads:
            try:
                self.check_update(plan)
            except ValueError as refusal:
                self._refuse(plan, str(refusal))
        if self.announce is not None:
            self.announce("update", plan.as_args())
        spec, group = self.groups[plan.group_name]
        staged: list[tuple[str, torch.Tensor]] = []
        error = None
        try:
            for name, dtype, shape in zip(plan.names, plan.dtypes, plan.shapes, strict=True):
                tensor = self._buffer(spec, dtype, shape)
                broadcast(group, tensor)
                staged.append((name, self._part(name, tensor)))
        except Exception as e:  # the trainer stopped sending, or a tensor did not fit in memory
            error = e
        if not self._agree(error is None):
            reason = error or "another tensor-parallel rank did not receive them"
            raise WeightUpdateError(f"no weight was updated: receiving {len(plan.names)} tensors over group "
                                    f"{plan.group_name!r} failed after {len(staged)} ({reason})")
        with torch.no_grad():
            copied = load_named_tensors(self.model, staged)
        log.info("updated %d weights from group %r", copied, plan.group_name)
        return copied

    def drain(self, plan: BroadcastPlan) -> str:
        """Receive every tensor of `plan` over its (joined) group and drop it, one at a time,
        on every rank; returns what happened, for the refusal's message. Nothing changes."""
        spec, group = self.groups[plan.group_name]
        received, error = 0, None
        try:
            for dtype, shape in zip(plan.dtypes, plan.shapes, strict=True):
                broadcast(group, self._buffer(spec, dtype, shape))
                received += 1
        except Exception as e:  # the trainer stopped sending
            error = e
        if self._agree(error is None):
            return f"its {len(plan.names)} tensors were received and dropped"
        reason = error or "another tensor-parallel rank did not receive them"
        return f"receiving its {len(plan.names)} tensors to drop them failed after {received} ({reason})"

    def check_unreceived(self, plan: BroadcastPlan) -> None:
        """ValueError for a plan refused with nothing received: `check_update` refuses it
        and its tensors cannot be drained. A plan that passes may still be refused by
        `update`, once its tensors were received and dropped."""
        try:
            self.check_update(plan)
        except ValueError as refusal:
            if (undrained := self._undrained(plan)) is not None:
                raise ValueError(f"{refusal}{undrained}") from None

    def _refuse(self, plan: BroadcastPlan, refusal: str) -> NoReturn:
        """The leading rank: raise ValueError(`refusal`), after draining `plan`'s tensors on
        every rank where the group is joined and every tensor is small enough."""
        if (undrained := self._undrained(plan)) is not None:
            raise ValueError(f"{refusal}{undrained}")
        if self.announce is not None:
            self.announce("drain", plan.as_args())
        drained = self.drain(plan)
        log.warning("refused an update over group %r (%s); %s", plan.group_name, refusal, drained)
        raise ValueError(f"{refusal}; {drained}, no weight changed")

    def _undrained(self, plan: BroadcastPlan) -> str | None:
        """Why `plan`'s tensors cannot be drained (the end of a refusal's message), or None:
        its group is not joined, or a tensor is more than `DRAIN_FACTOR` times the largest weight."""
        if plan.group_name not in self.groups:
            return ""
        limit = DRAIN_FACTOR * max(p.numel() for p in self._whole_model().parameters())
        if any(math.prod(shape) > limit for shape in plan.shapes):
            return (f"; nothing was received (a tensor is more than {DRAIN_FACTOR} times the model's largest "
                    "weight), so the trainer's broadcast waits until it times out")
        return None

    # ------------------------------------------------------------------ internals
    @property
    def _rank(self) -> int:
        return 0 if self.tp is None else self.tp.rank

    def _agree(self, ok: bool) -> bool:
        return ok if self.tp is None else self.tp.all_agree(ok)

    def _buffer(self, spec: GroupSpec, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        """An empty tensor to receive one broadcast into: on the model's CUDA device over
        NCCL, on the CPU over gloo."""
        on = self.device if spec.backend == "nccl" else torch.device("cpu")
        return torch.empty(shape, dtype=getattr(torch, dtype_name(dtype)), device=on)

    def _whole_model(self) -> nn.Module:
        """The model whose shapes a broadcast tensor has (unsplit, as a checkpoint holds
        it), on the meta device: checking against it allocates nothing."""
        if self._whole is None:
            with torch.device("meta"):
                self._whole = model_class(self.config.architecture)(self.config)
        return self._whole

    def _part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of checkpoint tensor `name` (`tensor` itself without tensor parallelism)."""
        if self.tp is None:
            return tensor
        param, shard = checkpoint_target(self.model, name)
        owner, _, leaf = param.rpartition(".")
        index = getattr(self.model.get_submodule(owner), "checkpoint_index", None)
        return tensor if index is None else tensor[index(leaf, shard)].clone()


def _shut(group: dist.ProcessGroup) -> None:
    """Close `group`'s connections."""
    try:
        group.shutdown()
    except Exception as e:  # a member already gone: its connections are closed anyway
        log.debug("closing a weight-update group: %s", e)
