"""Speculative decoding: drafters propose a request's next tokens, the target verifies
them all in one forward pass, and an acceptance rule keeps the output distribution (and
a seeded request's tokens) exactly what plain decoding gives. The decoder is
`decode.SpeculativeDecoder`, the drafters' registry `drafter.DRAFTERS`."""
