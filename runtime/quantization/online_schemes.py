"""What `--quantization` and `--quantization-group-size` accept: the online schemes by
name and the group sizes int4 takes. Torch-free, so that `RunnerConfig` and the CLI's
choices import nothing heavy; `formats.online.OnlineFormat` builds the schemes."""

from __future__ import annotations

ONLINE_SCHEMES = ("int8", "int4", "fp8")  # the keys of formats.online.SCHEMES
ONLINE_GROUP_SIZES = (32, 64, 128)


def check_online_scheme(name: str, group_size: int) -> None:
    """`ValueError` unless `name` is one of `ONLINE_SCHEMES` and `group_size` one of
    `ONLINE_GROUP_SIZES` (checked for every scheme, though only int4 uses it)."""
    if name not in ONLINE_SCHEMES:
        raise ValueError(f"quantization must be one of {ONLINE_SCHEMES}, got {name!r}")
    if group_size not in ONLINE_GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {ONLINE_GROUP_SIZES}, got {group_size}")
