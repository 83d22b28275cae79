"""Speculative decoding: drafters propose a request's next tokens, the target verifies
them all in one forward pass, and an acceptance rule keeps the output distribution (and
a seeded request's tokens) exactly what plain decoding gives."""

from sprig.runtime.speculative.decode import SpeculativeDecoder, SpeculativeStats
from sprig.runtime.speculative.drafter import DRAFTERS, Drafter

__all__ = ["DRAFTERS", "Drafter", "SpeculativeDecoder", "SpeculativeStats"]
