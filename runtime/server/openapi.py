"""The server's OpenAPI document (`/openapi.json`): FastAPI's description of the routes,
with each JSON body's schema taken from the pydantic model its route validates it
against (the routes read bodies themselves, to answer errors in OpenAI's format, or
Anthropic's on its Messages routes), and the API key as a bearer scheme or an
`x-api-key` header (what Anthropic's clients send). Clients and fuzzers (schemathesis)
read it."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from sprig.runtime.server.messages_protocol import CountTokensRequest, MessagesRequest
from sprig.runtime.server.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DestroyWeightsUpdateGroupRequest,
    EmbeddingRequest,
    EncodeRequest,
    GenerateRequest,
    GetWeightsByNameRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterRequest,
    PauseGenerationRequest,
    ScoringRequest,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightVersionRequest,
)
from sprig.runtime.server.protocol_tokens import DetokenizeRequest, TokenizeRequest
from sprig.runtime.server.responses_protocol import ResponsesRequest

BODIES: dict[str, type[BaseModel]] = {  # path of a POST route -> its body's model
    "/generate": GenerateRequest,
    "/abort_request": AbortRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/score": ScoringRequest,
    "/encode": EncodeRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/update_weights_from_disk": UpdateWeightsFromDiskRequest,
    "/update_weight_version": UpdateWeightVersionRequest,
    "/get_weights_by_name": GetWeightsByNameRequest,
    "/load_lora_adapter": LoadLoRAAdapterRequest,
    "/unload_lora_adapter": UnloadLoRAAdapterRequest,
    "/pause_generation": PauseGenerationRequest,
    "/init_weights_update_group": InitWeightsUpdateGroupRequest,
    "/update_weights_from_distributed": UpdateWeightsFromDistributedRequest,
    "/destroy_weights_update_group": DestroyWeightsUpdateGroupRequest,
}
OPTIONAL_BODIES = frozenset({"/pause_generation", "/destroy_weights_update_group"})  # no body: the model's defaults
ERRORS = {"400": "invalid request (the error names the field)", "401": "missing or wrong API key",
          "408": "the body arrived too slowly", "413": "the body is too large",
          "429": "the server is full; retry after Retry-After seconds", "503": "the server cannot serve"}


def openapi_document(app: FastAPI, version: str, api_key: bool) -> dict[str, Any]:
    """The document, built once and kept on `app`."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title="sprig", version=version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in BODIES.items():
        schema = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        op = doc["paths"][path]["post"]
        op["requestBody"] = {"required": path not in OPTIONAL_BODIES, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    for item in doc["paths"].values():
        for op in item.values():
            op.setdefault("responses", {}).update(
                {code: {"description": text} for code, text in ERRORS.items()}
            )
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                                "x_api_key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
        doc["security"] = [{"bearer": []}, {"x_api_key": []}]
    app.openapi_schema = doc
    return doc
