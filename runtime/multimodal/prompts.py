"""Prompts with images: each image's placeholders put into the prompt as the model's
processor puts them, and the image's pixel values computed by the checkpoint's own image
processor (`preprocessor_config.json`, read by transformers).

A prompt names where an image goes with the model's begin-of-image token (Gemma 3:
`<start_of_image>`, what its chat template writes for an image part and what
`sgl.image` writes): one per image, in order. Each becomes the model's full image
sequence (Gemma 3: two newlines, the begin token, `tokens_per_image` image tokens, the
end token, two newlines), in the text before tokenizing, as transformers' processor
does, so the ids equal its own. A prompt given as ids may hold the begin token (expanded
the same way, the newlines as the tokenizer spells them alone) or the full sequences
already.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from sprig.runtime.model_config import ImageSpec
from sprig.runtime.multimodal.inputs import ImageInput
from sprig.runtime.multimodal.media import MediaError, MediaLimits, load_image
from sprig.runtime.request_contract import InvalidRequest, prompt_rows

log = logging.getLogger("sprig.multimodal")

MAX_IMAGES_PER_PROMPT = 16
IMAGE_FIELD = "image_data"


class ImagePrompter:
    """Builds the prompts of a model that takes images (`ImageSpec`); every problem is an
    `InvalidRequest` naming the field (`image_data` unless the caller names another).

    Invariant of what it returns: the prompt holds exactly one run of
    `spec.tokens_per_image` image tokens per image, in order, and each `ImageInput`
    points at its run."""

    def __init__(self, model_path: str | Path, spec: ImageSpec, tokenizer: Any, limits: MediaLimits) -> None:
        """Raises ValueError if the checkpoint has no image processor sprig can run."""
        from transformers import AutoImageProcessor

        self.spec = spec
        self.tokenizer = tokenizer
        self.limits = limits
        try:
            # transformers falls back to its PIL backend without torchvision (and warns): choose it then
            backend = None if importlib.util.find_spec("torchvision") else "pil"
            self.processor = AutoImageProcessor.from_pretrained(str(model_path), local_files_only=True, backend=backend)
        except (OSError, ValueError) as e:
            raise ValueError(f"{model_path}: cannot load its image processor (preprocessor_config.json): {e}") from None
        if getattr(self.processor, "do_pan_and_scan", False):
            raise ValueError(f"{model_path}: preprocessor_config.json sets do_pan_and_scan, which sprig does not "
                             "implement; set it to false")
        begin, token, end = tokenizer.convert_ids_to_tokens([spec.begin_id, spec.token_id, spec.end_id])
        self.begin_text = begin
        self.sequence_text = f"\n\n{begin}{token * spec.tokens_per_image}{end}\n\n"
        newlines = tokenizer.encode("\n\n", add_special_tokens=False)
        self.sequence_ids = [*newlines, spec.begin_id, *[spec.token_id] * spec.tokens_per_image, spec.end_id,
                             *newlines]

    def prompt(self, prompt: str | list[int], sources: Sequence[Any], encode: Callable[[str], list[int]], *,
               param: str, field: str = IMAGE_FIELD) -> tuple[list[int], tuple[ImageInput, ...]]:
        """One prompt (a text, tokenized by `encode`, or ids; named `param`) with its image
        placeholders expanded, and its `sources` (named `field`) loaded and processed:
        the cheap checks first."""
        self.count_check(sources, field)
        ids = (self.text(prompt, len(sources), encode, field=param) if isinstance(prompt, str)
               else self.ids(prompt, len(sources), field=param))
        return ids, self.images(ids, sources, field)

    # ------------------------------------------------------------------ cheap checks
    def count_check(self, sources: Sequence[Any], field: str = IMAGE_FIELD) -> None:
        """Refuse more than `MAX_IMAGES_PER_PROMPT` images, before any is read."""
        if len(sources) > MAX_IMAGES_PER_PROMPT:
            raise InvalidRequest(f"{len(sources)} images in one prompt; at most {MAX_IMAGES_PER_PROMPT}", field)

    def text(self, text: str, images: int, encode: Callable[[str], list[int]], field: str = "text") -> list[int]:
        """`text` with each begin-of-image token expanded, tokenized by `encode`; the
        begin tokens must number `images`."""
        found = text.count(self.begin_text)
        if found != images:
            raise InvalidRequest(
                f"{field} holds {found} image placeholders ({self.begin_text}) for {images} images: put one where "
                f"each image goes", IMAGE_FIELD)
        return encode(text.replace(self.begin_text, self.sequence_text) if images else text)

    def ids(self, ids: list[int], images: int, field: str = "input_ids") -> list[int]:
        """`ids` with each begin-of-image token expanded, unless they hold the full image
        sequences already; the images must number `images` either way."""
        if self.spec.token_id in ids:
            return ids
        found = ids.count(self.spec.begin_id)
        if found != images:
            raise InvalidRequest(f"{field} holds {found} image placeholders (token {self.spec.begin_id}) for "
                                 f"{images} images", IMAGE_FIELD)
        out: list[int] = []
        for t in ids:
            out.extend(self.sequence_ids if t == self.spec.begin_id else (t,))
        return out

    # ------------------------------------------------------------------ the images
    def images(self, ids: list[int], sources: Sequence[Any], field: str = IMAGE_FIELD) -> tuple[ImageInput, ...]:
        """Each source loaded (`media.load_image`; a PIL image is taken as it is) and
        processed, paired with its run of image tokens in `ids`."""
        runs = image_runs(ids, self.spec.token_id)
        if len(runs) != len(sources) or any(n != self.spec.tokens_per_image for _, n in runs):
            raise InvalidRequest(
                f"the prompt holds {len(runs)} runs of image tokens (lengths {[n for _, n in runs]}) for "
                f"{len(sources)} images; each image takes one run of {self.spec.tokens_per_image}", field)
        if not sources:
            return ()
        loaded = []
        for i, source in enumerate(sources):
            try:
                loaded.append(source if hasattr(source, "getpixel") else load_image(source, self.limits))
            except MediaError as e:
                raise InvalidRequest(f"{field}[{i}]: {e}", field) from None
        pixels = self.processor(images=loaded, return_tensors="pt")["pixel_values"]  # [N, C, H, W]
        return tuple(ImageInput.of(p, start, n) for p, (start, n) in zip(pixels.to(torch.float32), runs, strict=True))


def prompts_with_images(prompter: ImagePrompter, text: Any, input_ids: Any, image_data: Any,
                        encode: Callable[[str], list[int]], *,
                        param: str) -> tuple[bool, list[list[int]], list[tuple[ImageInput, ...]]]:
    """`request_contract.prompt_rows` for prompts with images: (is_batch, each prompt's
    ids, each prompt's images), the images from SGLang's `image_data`
    (`images_per_prompt`), each prompt built as `ImagePrompter.prompt` builds one (a text
    is tokenized by `encode` once its placeholders are expanded; `param` names it), every
    prompt's cheap checks before any image is read. Raises `InvalidRequest` naming the
    field."""
    if text is not None and input_ids is None:
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise InvalidRequest(f"{param} must be a string or a non-empty list of strings", param)
        batch, given = not isinstance(text, str), list(texts)
    else:
        batch, given = prompt_rows(text, input_ids, encode, text_field=param)
    per_prompt = images_per_prompt(image_data, len(given))
    for sources in per_prompt:  # every cheap check before any prompt's images are read
        prompter.count_check(sources)
    rows = [prompter.text(p, len(sources), encode, field=param) if isinstance(p, str)
            else prompter.ids(p, len(sources)) for p, sources in zip(given, per_prompt, strict=True)]
    return batch, rows, [prompter.images(ids, sources) for ids, sources in zip(rows, per_prompt, strict=True)]


def load_prompter(model_path: str | Path, spec: ImageSpec | None, tokenizer: Any, limits: MediaLimits,
                  refusal: str) -> tuple[ImagePrompter | None, str]:
    """The `ImagePrompter` of a model that takes images (`spec`), or None and why requests
    with images are refused: `refusal` when the served model takes none (`spec` None:
    `ModelRunner.no_images`), or its checkpoint has no image processor sprig can run
    (logged as a warning: it serves text)."""
    if spec is None:
        return None, refusal
    try:
        return ImagePrompter(model_path, spec, tokenizer, limits), ""
    except ValueError as e:
        log.warning("%s; serving text only", e)
        return None, f"this server takes no images: {e}".replace(str(model_path), "the checkpoint")


def image_runs(ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token_id` in `ids`, in order."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate(ids):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append((start, i - start))
            start = None
    if start is not None:
        runs.append((start, len(ids) - start))
    return runs


def images_per_prompt(image_data: Any, prompts: int, field: str = IMAGE_FIELD) -> list[list[Any]]:
    """SGLang's shapes of `image_data`: None; one image (a string) or a list of images for
    a single prompt; for a batch, a list with one entry (None, an image or a list of
    images) per prompt."""
    if image_data is None:
        return [[] for _ in range(prompts)]
    if prompts == 1 and not (isinstance(image_data, list) and len(image_data) == 1 and isinstance(image_data[0], list)):
        return [image_data if isinstance(image_data, list) else [image_data]]
    if not isinstance(image_data, list) or len(image_data) != prompts:
        raise InvalidRequest(f"{field} must have one entry per prompt ({prompts})", field)
    return [[] if entry is None else entry if isinstance(entry, list) else [entry] for entry in image_data]
