"""SGLang's LoRA adapter routes, for serving adapters that come and go without a restart:

- `POST /load_lora_adapter` `{"lora_name", "lora_path", "pinned"?}`: read the PEFT adapter
  at `lora_path` (on the server's machine) into a free adapter slot; later requests name it
  in `lora_path` (`/generate`, and the OpenAI routes), or as the OpenAI `model`
  ("ADAPTER" or "MODEL:ADAPTER"). 200 `{"success": true, "error_message": null,
  "loaded_adapters": {name: path}}`, or 400 with `success: false` and why (LoRA not
  enabled, the name taken, no free slot, not an adapter, modules or a rank the server was
  not started for). `pinned` is accepted and changes nothing: every adapter stays loaded
  until unloaded.
- `POST /unload_lora_adapter` `{"lora_name"}`: free its slot and drop the prefixes cached
  with it; 400 while a request in flight uses it.

The path is read by the scheduler process: guard the server with `--api-key` where others
can reach it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from sprig.runtime.server.errors import parse
from sprig.runtime.server.http_io import json_response, prepare, state_of
from sprig.runtime.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from sprig.runtime.wire import ControlReply

router = APIRouter()


def _answer(request: Request, reply: ControlReply) -> Response:
    state_of(request).manager.weights.adapters = dict(reply.data["loaded_adapters"])
    return json_response({"success": reply.ok, **reply.data}, 200 if reply.ok else 400)


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    req: LoadLoRAAdapterRequest = await prepare(request, lambda b: parse(LoadLoRAAdapterRequest, b), new_work=False)
    reply = await state_of(request).manager.control(
        "load_lora_adapter", {"lora_name": req.lora_name, "lora_path": req.lora_path}, timeout=None)
    return _answer(request, reply)


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    req: UnloadLoRAAdapterRequest = await prepare(request, lambda b: parse(UnloadLoRAAdapterRequest, b),
                                                  new_work=False)
    reply = await state_of(request).manager.control("unload_lora_adapter", {"lora_name": req.lora_name},
                                                    timeout=None)
    return _answer(request, reply)
