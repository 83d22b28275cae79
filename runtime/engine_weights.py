"""The offline engine's calls on the served model's weights, as SGLang's `Engine` has them:
updates from a checkpoint, from tensors and from a trainer's broadcast over a process
group, and reading a weight back."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from sprig.runtime.scheduler.config import check_weight_version
from sprig.runtime.weight_update import (
    DEFAULT_GROUP,
    BroadcastPlan,
    GroupSpec,
    WeightUpdateError,
    check_load_format,
    check_truncate_size,
    update_message,
)

if TYPE_CHECKING:
    from sprig.runtime.distributed.runner import TPRunner
    from sprig.runtime.engine_driver import EngineDriver
    from sprig.runtime.model_runner import ModelRunner
    from sprig.runtime.scheduler.scheduler import Scheduler


class EngineWeights:
    """`Engine`'s weight calls. Each runs between scheduler steps (`_driver.call`); the
    updates refuse while requests are in flight (`_update_refusal`), so no request runs on
    two sets of weights. The engine provides `scheduler`, `runner`, `_driver` and
    `_sync_calls` (the `generate` streams being read)."""

    scheduler: Scheduler
    runner: ModelRunner | TPRunner
    _driver: EngineDriver
    _sync_calls: int

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 weight_version: str | None = None) -> tuple[bool, str, int]:
        """Load new weights for the served model from the checkpoint directory
        `model_path` (safetensors; the same architecture and shapes, any float dtype) and
        empty the radix cache, as SGLang's does: returns `(success, message,
        num_paused_requests)`, the last always 0 here (the engine holds no requests back).
        On failure the previous weights stay in place and `message` says why. Refused
        (False) while requests are in flight (async calls, or a `generate` stream being
        read): no request runs on two sets of weights.
        `weight_version` labels the responses of later requests (`meta_info`);
        `load_format` is None, "auto" or "safetensors"."""
        try:
            check_load_format(load_format)
            if weight_version is not None:
                check_weight_version(weight_version)
        except ValueError as e:
            return False, str(e), 0
        if (busy := self._update_refusal()) is not None:
            return False, busy, 0
        try:
            self._driver.call(lambda: self.scheduler.update_weights(str(model_path), weight_version))
        except WeightUpdateError as e:
            return False, str(e), 0
        return True, update_message(weight_version), 0

    def update_weights_from_tensor(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                                   load_format: str | None = None, flush_cache: bool = True,
                                   weight_version: str | None = None) -> tuple[bool, str]:
        """Copy `(name, tensor)` pairs into the model's weights, as SGLang's does: the
        names a checkpoint would use (a transformers model's `named_parameters()` as they
        are, or any subset of them), any float dtype and device; returns `(success,
        message)`. All are checked before any is copied, so on failure (an unknown name, a
        tensor of another shape, a quantized layer's weight, weights split over
        tensor-parallel ranks) nothing has changed. The radix cache is dropped after every
        call: `flush_cache=False`, which SGLang takes for all but the last of a run of
        partial updates, is accepted and changes nothing (an empty cache is dropped for
        free). Refused while requests are in flight, as `update_weights_from_disk` is.
        `load_format`: None or "direct"."""
        if load_format not in (None, "direct"):
            return False, f"load_format must be null or 'direct' (tensors are copied as they are), got {load_format!r}"
        if weight_version is not None:
            try:
                check_weight_version(weight_version)
            except ValueError as e:
                return False, str(e)
        if (busy := self._update_refusal()) is not None:
            return False, busy
        tensors = list(named_tensors)
        try:
            copied = self._driver.call(lambda: self.scheduler.update_weights_from_tensors(tensors, weight_version))
        except WeightUpdateError as e:
            return False, str(e)
        return True, update_message(weight_version, copied)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = DEFAULT_GROUP, backend: str = "nccl") -> tuple[bool, str]:
        """Join the process group a trainer (its rank 0) hosts at `master_address:master_port`,
        as SGLang's does: tensor-parallel rank r joins as `rank_offset + r` of `world_size`;
        returns `(success, message)`. Blocks until every member has joined (the trainer
        joins at the same time), at most `weight_sync.JOIN_TIMEOUT_S`; on failure no rank
        has joined. `backend` is "gloo" (CPU tensors) or "nccl" (a CUDA model)."""
        try:
            spec = GroupSpec(master_address, master_port, rank_offset, world_size, group_name, backend)
            return True, self._driver.call(lambda: self.runner.weight_groups.join(spec))
        except (ValueError, TypeError) as e:
            return False, str(e)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = DEFAULT_GROUP, flush_cache: bool = True,
                                        weight_version: str | None = None,
                                        load_format: str | None = None) -> tuple[bool, str]:
        """Receive tensors the trainer broadcasts (from its rank 0) over group `group_name`,
        in the order of `names`, each of its dtype and shape, and copy them into the
        model's weights, as SGLang's does; returns `(success, message)`. The names, dtypes
        and shapes are checked against the model before anything is copied: arguments
        refused before the call, or while requests are in flight, receive nothing; names or
        shapes the model refuses are refused once the tensors were received and dropped
        (the trainer's broadcast ends). The weights change only if all arrived, on every
        rank. The radix cache is dropped (`flush_cache=False` changes nothing, as for
        `update_weights_from_tensor`)."""
        try:
            if load_format is not None:
                raise ValueError(f"load_format must be null (tensors are copied as they are), got {load_format!r}")
            if weight_version is not None:
                check_weight_version(weight_version)
            plan = BroadcastPlan(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes), group_name)
        except (ValueError, TypeError) as e:
            return False, str(e)
        if (busy := self._update_refusal()) is not None:
            return False, busy

        def receive() -> int:
            copied = self.runner.weight_groups.update(plan)
            self.scheduler.weights_loaded(weight_version)
            return copied

        try:
            copied = self._driver.call(receive)
        except ValueError as e:
            return False, str(e)
        return True, update_message(weight_version, copied)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> tuple[bool, str]:
        """Leave weight-update group `group_name` on every rank; `(success, message)`."""
        try:
            return True, self._driver.call(lambda: self.runner.weight_groups.leave(group_name))
        except ValueError as e:
            return False, str(e)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows of the weight a checkpoint names `name`, as float32
        nested lists (SGLang's call, for checking that an update arrived); ValueError for an
        unknown or quantized name, or weights split over tensor-parallel ranks."""
        check_truncate_size(truncate_size)
        return self._driver.call(lambda: self.runner.get_weights_by_name(name, truncate_size))

    def _update_refusal(self) -> str | None:
        """Why the weights cannot change now (requests in flight), or None."""
        if self._driver.busy:
            return "cannot update the weights while async_generate calls are in flight: await them first"
        if self._sync_calls:
            return "cannot update the weights while a generate stream is being read: finish or close it first"
        return None
