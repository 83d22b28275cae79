"""The torch attention backend, sprig's CPU path: shared-prefix (cascade) attention over
padded buckets, with gathered K/V kept across decode steps. Its plain counterpart, which
it is checked against in shadow mode, is `sprig.runtime.attention.reference`."""

from sprig.runtime.attention.cpu.backend import TorchAttentionBackend

__all__ = ["TorchAttentionBackend"]
