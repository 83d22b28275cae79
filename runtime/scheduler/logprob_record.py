"""Input logprobs: which rows of an extend step's logits a request needs, and recording
the logprob of each prompt token from them (output logprobs come with each sample)."""

from __future__ import annotations

import torch

from sprig.runtime.sampling.logprobs import picked_logprobs, token_logprobs
from sprig.runtime.scheduler.admission import Extend
from sprig.runtime.scheduler.request import Req


def logits_from(ext: Extend) -> int:
    """First new-token row whose logits this step needs (the last one at least)."""
    req = ext.req
    if not req.wants_input_logprobs:
        return ext.length - 1
    first_needed = max(req.logprob_start_len, 1) - 1
    return min(max(0, first_needed - req.kv_len), ext.length - 1)


def record_input_logprobs(req: Req, rows: torch.Tensor, first_pos: int) -> None:
    """`rows[i]` holds the model's prediction after position `first_pos + i`; record the
    logprob of each prompt token at or after `logprob_start_len` it predicts."""
    prompt, start = req.prompt_ids, req.logprob_start_len
    if start == 0 and not req.input_logprobs:
        req.input_logprobs.append((None, prompt[0]))
        req.input_top_logprobs.append(None)
        if req.token_ids_logprob:
            req.input_token_ids_logprobs.append(None)
    positions = [first_pos + i for i in range(rows.shape[0])]
    keep = [i for i, pos in enumerate(positions) if max(start, 1) <= pos + 1 < len(prompt)]
    if not keep:
        return
    targets = torch.tensor([prompt[positions[i] + 1] for i in keep], device=rows.device)
    chosen, top = token_logprobs(rows[keep], targets, top_k=req.top_logprobs_num)
    top_vals = (top.values.tolist(), top.ids.tolist()) if top is not None else None
    ids = req.token_ids_logprob
    picked = picked_logprobs(rows[keep], [ids] * len(keep)) if ids else None
    for j, (lp, tok) in enumerate(zip(chosen.tolist(), targets.tolist(), strict=True)):
        req.input_logprobs.append((lp, tok))
        req.input_top_logprobs.append(list(zip(top_vals[0][j], top_vals[1][j], strict=True)) if top_vals else None)
        if picked is not None:
            req.input_token_ids_logprobs.append(list(zip(picked[j], ids, strict=True)))
