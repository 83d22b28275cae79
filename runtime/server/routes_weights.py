"""SGLang's weight-update routes, for reinforcement-learning loops that serve rollouts from
the policy being trained:

- `POST /update_weights_from_disk` `{"model_path", "weight_version"?, "abort_all_requests"?,
  "load_format"?}`: load a checkpoint of the same model (its safetensors, in any float
  dtype) in place and drop the radix cache. It waits for the requests already sent to
  finish (or aborts them, with `abort_all_requests`), and requests sent meanwhile wait for
  it (`weight_updates`), so each request runs on one set of weights. 200 `{"success":
  true, "message", "num_paused_requests"}` (the requests that waited), or 400 `{"success":
  false, "message"}` with the old weights in place. The tokenizer and the served model
  name stay those the server started with; `/get_model_info`'s `model_path` names the
  checkpoint loaded.
- `POST /update_weight_version` `{"new_version", "abort_all_requests"?}`: a new label for
  the weights in place, carried by the responses of requests sent after it
  (`meta_info["weight_version"]`).
- `GET /get_weight_version`: the current label.
- `POST /pause_generation` `{"mode"?}` and `POST /continue_generation`: stop generating
  around a weight sync, and go on (`Scheduler.pause`). "abort" (the default) ends the
  requests in flight with what they wrote; "retract" requeues them, K/V released, so an
  update may follow and they resume on the new weights, each with its output so far kept
  (labelled with the new version); "in_place" keeps them where they are, K/V included,
  and an update is then refused (400) until they finish or are aborted. Requests sent
  while paused wait in the queue. Both answer 200 `{"success": true, "message"}`; pausing
  adds the mode and how many requests it acted on. A body, if any, must be JSON.
- `GET` or `POST /get_weights_by_name` `{"name", "truncate_size"?}`: the first rows (100 by
  default) of a float weight by its checkpoint name, as float32 nested lists, for checking
  that an update arrived (not under tensor parallelism, where each rank holds a part).

- `POST /init_weights_update_group` `{"master_address", "master_port", "rank_offset",
  "world_size", "group_name"?, "backend"?}`: every rank of the model joins the process
  group a trainer (its rank 0) hosts at that address, as rank `rank_offset + tp_rank`
  (`distributed.weight_sync`); it waits for the requests in flight, as an update does,
  and at most `weight_sync.JOIN_TIMEOUT_S` for the trainer. `backend` "gloo" for a model
  on CPU, "nccl" on CUDA.
- `POST /update_weights_from_distributed` `{"names", "dtypes", "shapes", "group_name"?,
  "weight_version"?, "abort_all_requests"?, "flush_cache"?}`: an update as from disk (the
  same queue, held requests and labels), its tensors received from the trainer's
  broadcasts over the group, in order. Every name, dtype and shape is checked against
  the model before anything is copied: a request the body's checks refuse (a 400 before
  the queue) or naming a group not joined receives nothing; one the model refuses (a
  name it lacks, a shape it does not have) is a 400 once its tensors were received and
  dropped (`weight_sync.WeightGroups.drain`), so the trainer's broadcast ends. The
  weights change only if all arrived, on every rank.
- `POST /destroy_weights_update_group` `{"group_name"?}`: leave the group.
  The three answer 200 `{"success": true, "message"}` or 400 `{"success": false, "message"}`.

The model path is read by the scheduler process, on the server's machine (and, under
tensor parallelism, by every rank at that path): guard the server with `--api-key` where
others can reach it. A weight-update group makes every rank connect to the address a
client names and take the tensors sent there: the routes are guarded by `--api-key` like
every other, and no tensor is allocated before its name and shape are checked. At most
`MAX_PENDING_UPDATES` updates and group calls wait their turn at once (each loads a
whole checkpoint, or waits for a trainer); more are a 429.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from starlette.responses import Response

from sprig.runtime.server.errors import ApiError, parse
from sprig.runtime.server.http_io import json_response, parse_json, prepare, read_body, state_of
from sprig.runtime.server.protocol import (
    DestroyWeightsUpdateGroupRequest,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightVersionRequest,
)
from sprig.runtime.server.request_manager import RequestFailed
from sprig.runtime.weight_update import BroadcastPlan, GroupSpec, check_load_format

router = APIRouter()
T = TypeVar("T")
MAX_PENDING_UPDATES = 8  # weight updates waiting their turn at once; more are a 429


def _update_args(body: Any) -> dict[str, Any]:
    req: UpdateWeightsFromDiskRequest = parse(UpdateWeightsFromDiskRequest, body)
    try:
        check_load_format(req.load_format)
    except ValueError as e:
        raise ApiError(400, str(e), "load_format") from None
    if not req.flush_cache:
        raise ApiError(400, "flush_cache must be true: cached prefixes hold K/V the old weights computed, so a "
                       "weight update always drops them", "flush_cache")
    return {"model_path": req.model_path, "weight_version": req.weight_version,
            "abort_all_requests": req.abort_all_requests}


def _group_args(body: Any) -> dict[str, Any]:
    req: InitWeightsUpdateGroupRequest = parse(InitWeightsUpdateGroupRequest, body)
    args = req.model_dump()
    try:
        GroupSpec(**args)
    except ValueError as e:
        raise ApiError(400, str(e), _field(str(e), args)) from None
    return args


def _distributed_args(body: Any) -> dict[str, Any]:
    req: UpdateWeightsFromDistributedRequest = parse(UpdateWeightsFromDistributedRequest, body)
    one = (req.name, req.dtype, req.shape)
    if req.names is None and req.dtypes is None and req.shapes is None and None not in one:
        names, dtypes, shapes = [req.name], [req.dtype], [req.shape]
    elif any(v is not None for v in one):
        raise ApiError(400, "give names, dtypes and shapes, or SGLang's earlier name, dtype and shape (not both, "
                       "and not part of either)", "names")
    else:
        names, dtypes, shapes = req.names or [], req.dtypes or [], req.shapes or []
    if req.load_format is not None:
        raise ApiError(400, f"load_format must be null (tensors are copied as they are), got {req.load_format!r}",
                       "load_format")
    try:
        plan = BroadcastPlan(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes), req.group_name)
    except ValueError as e:
        raise ApiError(400, str(e), _field(str(e), {"names": 0, "dtypes": 0, "shapes": 0})) from None
    return {**plan.as_args(), "weight_version": req.weight_version, "abort_all_requests": req.abort_all_requests}


def _field(message: str, fields: dict[str, Any]) -> str:
    """The field a check's `message` names first (they start with it, or say it)."""
    return next((f for f in fields if message.startswith(f)), next((f for f in fields if f in message), "body"))


async def _queued(request: Request, kind: str, args: dict[str, Any]) -> Any:
    """The scheduler's reply to update or group call `kind`, which waits its turn
    (`weight_updates`); 429 when `MAX_PENDING_UPDATES` wait already."""
    manager = state_of(request).manager
    if manager.pending_updates >= MAX_PENDING_UPDATES:
        raise RequestFailed(429, f"{MAX_PENDING_UPDATES} weight updates are waiting their turn already; retry later")
    manager.pending_updates += 1
    try:
        return await manager.control(kind, args, timeout=None)
    finally:
        manager.pending_updates -= 1


def _answer(reply: Any) -> Response:
    return json_response({"success": reply.ok, "message": reply.data["message"]}, 200 if reply.ok else 400)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> Response:
    reply = await _queued(request, "update_weights", await prepare(request, _update_args, new_work=False))
    if not reply.ok:
        return _answer(reply)
    return json_response({"success": True, "message": reply.data["message"],
                          "num_paused_requests": reply.data["num_paused_requests"]})


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> Response:
    args = await prepare(request, _group_args, new_work=False)
    return _answer(await _queued(request, "init_weights_update_group", args))


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> Response:
    args = await prepare(request, _distributed_args, new_work=False)
    return _answer(await _queued(request, "update_weights_from_distributed", args))


async def _optional_body(request: Request, model: type[T]) -> T:
    """`model` from the request's JSON body, parsed off the event loop; no body is `{}`."""
    body = await read_body(request)
    return await asyncio.get_running_loop().run_in_executor(
        state_of(request).pool, lambda: parse(model, parse_json(body) if body.strip() else {}))


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> Response:
    req = await _optional_body(request, DestroyWeightsUpdateGroupRequest)
    return _answer(await _queued(request, "destroy_weights_update_group", {"group_name": req.group_name}))


@router.post("/update_weight_version")
async def update_weight_version(request: Request) -> Response:
    st = state_of(request)
    req: UpdateWeightVersionRequest = await prepare(
        request, lambda body: parse(UpdateWeightVersionRequest, body), new_work=False
    )
    reply = await st.manager.control(
        "update_weight_version", {"weight_version": req.new_version, "abort_all_requests": req.abort_all_requests}
    )
    version = reply.data["weight_version"]
    return json_response({"success": True, "message": f"Weight version updated to {version}", "new_version": version})


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> Response:
    return json_response({"weight_version": state_of(request).manager.weights.weight_version})


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
async def get_weights_by_name(request: Request) -> Response:
    st = state_of(request)
    req: GetWeightsByNameRequest = await prepare(
        request, lambda body: parse(GetWeightsByNameRequest, body), new_work=False
    )
    reply = await st.manager.control("get_weights_by_name", {"name": req.name, "truncate_size": req.truncate_size})
    if not reply.ok:
        message = reply.data["message"]
        raise ApiError(400, message, "truncate_size" if message.startswith("truncate_size") else "name")
    return json_response(reply.data["weights"])


@router.post("/pause_generation")
async def pause_generation(request: Request) -> Response:
    req = await _optional_body(request, PauseGenerationRequest)
    reply = await state_of(request).manager.control("pause_generation", {"mode": req.mode}, timeout=None)  # after an update in progress
    return json_response({"success": True, "message": "Generation paused successfully.", "mode": req.mode,
                          "num_requests": reply.data["requests"]})


@router.post("/continue_generation")
async def continue_generation(request: Request) -> Response:
    await state_of(request).manager.control("continue_generation", timeout=None)
    return json_response({"success": True, "message": "Generation continued successfully."})
