"""What the scheduler hands the model runner each step (integers, CPU index tensors and
images' pixels), and how the runner turns it into a device-side `ForwardBatch`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sprig.radix.kv_cache import KVCache
from sprig.runtime.forward_batch import ForwardBatch, ForwardMode


@dataclass(frozen=True)
class StepImage:
    """Image embeddings a step takes: rows `row .. row + count - 1` of its new tokens get
    embeddings `first .. first + count - 1` of the image whose processed pixel values
    are `pixels` (`[C, H, W]` float32, CPU)."""

    pixels: torch.Tensor
    row: int
    first: int
    count: int


@dataclass(frozen=True)
class EncodedImages:
    """A step's images already encoded: its new tokens' rows `rows` (`[M]` int64, CPU) take
    the embeddings `embeds` (`[M, H]` in the model's dtype, on any device) in place of their
    tokens' own. A tensor-parallel group's rank 0 encodes a step's images once and sends
    the result to the other ranks (`sprig.runtime.distributed.step_message`)."""

    rows: torch.Tensor
    embeds: torch.Tensor


@dataclass
class ForwardStep:
    """One forward step over B requests, in request order.

    Invariants (checked on construction): the four per-request lists have length B >= 1;
    `len(input_ids) == sum(q_lens)`; every `q_len >= 1`, and `== 1` in DECODE mode;
    `kv_lens[b] >= q_lens[b]` (the context ends with the new tokens, whose slots are the
    last `q_lens[b]`); `kv_indices` is a 1-D integer CPU tensor of `sum(kv_lens)` slots,
    the contexts concatenated; `0 <= logits_from[b] <= q_lens[b] - 1`. EXTEND only:
    `images`, or their embeddings `encoded` (not both), lie within the new tokens;
    `attend_until`, when given, has one entry per new token, the exclusive end of the
    context positions it attends to (`ForwardBatch.attend_until`), between its position
    + 1 and its request's kv_len.
    """

    mode: ForwardMode
    input_ids: list[int]  # new tokens of all requests, flattened in request order
    q_lens: list[int]  # new tokens per request (decode: all 1)
    kv_lens: list[int]  # per request: tokens in its context, the new ones included
    kv_indices: torch.Tensor  # [sum(kv_lens)] int CPU: the contexts' slots, concatenated
    logits_from: list[int]  # per request: first new-token index whose next-token logits return
    lora_slots: list[int] | None = None  # per request: its LoRA adapter's slot, -1 for none; None: no adapters
    images: list[StepImage] = field(default_factory=list)
    attend_until: list[int] | None = None  # per new token; None: causal
    encoded: EncodedImages | None = None  # the images' embeddings, computed already (then `images` is empty)

    def __post_init__(self) -> None:
        n = len(self.q_lens)
        has_images = bool(self.images) or self.encoded is not None
        if (has_images or self.attend_until is not None) and self.mode is not ForwardMode.EXTEND:
            raise ValueError("images and attend_until belong to extend steps")
        if self.encoded is not None:
            rows, embeds = self.encoded.rows, self.encoded.embeds
            if self.images:
                raise ValueError("a step takes its images as pixels or as embeddings, not both")
            if rows.dim() != 1 or embeds.dim() != 2 or rows.numel() != embeds.shape[0]:
                raise ValueError("encoded images need one embedding row [M, H] per row index [M]")
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= len(self.input_ids)):
                raise ValueError("an image's rows lie outside the step's new tokens")
        if self.attend_until is not None and len(self.attend_until) != len(self.input_ids):
            raise ValueError(f"attend_until has {len(self.attend_until)} entries for {len(self.input_ids)} tokens")
        if any(im.count < 1 or im.row < 0 or im.row + im.count > len(self.input_ids) for im in self.images):
            raise ValueError("an image's rows lie outside the step's new tokens")
        if n == 0:
            raise ValueError("a step needs at least one request")
        if self.lora_slots is not None and len(self.lora_slots) != n:
            raise ValueError(f"lora_slots must have one entry per request; got {len(self.lora_slots)} for {n}")
        if len(self.kv_lens) != n or len(self.logits_from) != n:
            raise ValueError(
                f"q_lens, kv_lens, logits_from must have one entry per request; got "
                f"{n}, {len(self.kv_lens)}, {len(self.logits_from)}"
            )
        if len(self.input_ids) != sum(self.q_lens):
            raise ValueError(f"{len(self.input_ids)} input_ids but sum(q_lens) = {sum(self.q_lens)}")
        idx = self.kv_indices
        if idx.dim() != 1 or idx.device.type != "cpu" or idx.is_floating_point():
            raise ValueError("kv_indices must be a 1-D integer CPU tensor")
        if idx.numel() != sum(self.kv_lens):
            raise ValueError(f"{idx.numel()} kv_indices but sum(kv_lens) = {sum(self.kv_lens)}")
        decode = self.mode is ForwardMode.DECODE
        for b, (q_len, kv_len, first) in enumerate(zip(self.q_lens, self.kv_lens, self.logits_from, strict=True)):
            if q_len < 1 or (decode and q_len != 1):
                raise ValueError(f"request {b}: q_len {q_len} invalid in {self.mode.value} mode")
            if kv_len < q_len:
                raise ValueError(f"request {b}: {kv_len} kv slots < q_len {q_len}")
            if not 0 <= first <= q_len - 1:
                raise ValueError(f"request {b}: logits_from {first} not in [0, {q_len - 1}]")


def check_slots(kv_indices: torch.Tensor, rows_in_pool: int) -> None:
    """Raise ValueError unless every slot of `kv_indices` (non-empty) is a pool row."""
    low, high = torch.aminmax(kv_indices)
    if int(low) < 0 or int(high) >= rows_in_pool:
        raise ValueError(f"kv slot out of range [0, {rows_in_pool}) of the KV pool")


def build_forward_batch(
    step: ForwardStep, kv_cache: KVCache, device: torch.device
) -> tuple[ForwardBatch, torch.Tensor]:
    """The `ForwardBatch` for `step` on `device`, and the rows `[R]` of its new tokens whose
    logits are wanted (request order). All index math runs on the CPU; for another device
    the result crosses in one copy. Raises ValueError if a slot is outside the pool."""
    B = len(step.q_lens)
    q_lens = torch.tensor(step.q_lens, dtype=torch.int64)  # [B]
    kv_lens = torch.tensor(step.kv_lens, dtype=torch.int64)  # [B]
    qo_indptr = F.pad(q_lens.cumsum(0), (1, 0))  # [B+1]
    kv_indptr = F.pad(kv_lens.cumsum(0), (1, 0))  # [B+1]
    kv_indices = step.kv_indices.to(torch.int32)  # [N]; no copy when read from the token table
    check_slots(kv_indices, kv_cache.num_slots + kv_cache.page_size)
    T = int(qo_indptr[-1])
    req = torch.repeat_interleave(torch.arange(B), q_lens, output_size=T)  # [T] request of each new token
    local = torch.arange(T) - qo_indptr[req]  # [T] index among its request's new tokens
    positions = local + (kv_lens - q_lens)[req]  # [T]
    out_cache_loc = kv_indices[kv_indptr[req] + positions].to(torch.int64)  # [T]
    logits_from = torch.tensor(step.logits_from, dtype=torch.int64)
    logit_rows = torch.nonzero(local >= logits_from[req]).flatten()  # [R]
    input_ids = torch.tensor(step.input_ids, dtype=torch.int64)  # [T]
    parts = [input_ids, positions, qo_indptr, kv_indptr, kv_indices, out_cache_loc, logit_rows]
    if device.type != "cpu":
        parts[4] = kv_indices.to(torch.int64)
        parts = list(torch.cat(parts).to(device).split([p.numel() for p in parts]))
    ids_d, pos_d, qo_d, kv_d, idx_d, loc_d, rows_d = parts
    until = None
    if step.attend_until is not None:
        until = torch.tensor(step.attend_until, dtype=torch.int64)
        if bool(((until <= positions) | (until > kv_lens[req])).any()):
            raise ValueError("attend_until must lie in (position, kv_len] for every new token")
        until = until.to(device)
    lora = None
    if step.lora_slots is not None and max(step.lora_slots) >= 0:  # [T]: each new token's adapter slot
        lora = torch.tensor(step.lora_slots, dtype=torch.int64)[req].to(device)
    batch = ForwardBatch(
        mode=step.mode,
        input_ids=ids_d,
        positions=pos_d,
        qo_indptr=qo_d.to(torch.int32),
        kv_indptr=kv_d.to(torch.int32),
        kv_indices=idx_d.to(torch.int32),
        out_cache_loc=loc_d,
        kv_cache=kv_cache,
        max_q_len=max(step.q_lens),
        max_kv_len=int(kv_lens.max()),
        lora_slots=lora,
        attend_until=until,
    )
    return batch, rows_d
