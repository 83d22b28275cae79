"""A slow grammar compile runs beside the batch: an unconstrained request submitted with a
large schema gets all its tokens while the schema's request still waits for its grammar."""

from __future__ import annotations

import json

from engine_helpers import assert_idle_and_intact

from sprig.runtime import Engine
from sprig.runtime.sampling import SamplingParams
from sprig.runtime.scheduler.request import Req

FREE_TOKENS = 4


def slow_schema(n_props: int = 100, width: int = 300) -> str:
    """~3.5 s to compile with the tiny tokenizer (measured; ~35k DFA states): every
    property a required string of 1..`width` characters."""
    props = {f"field_{i}": {"type": "string", "pattern": f"[a-z0-9]{{1,{width}}}"} for i in range(n_props)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


def test_a_slow_compile_does_not_hold_back_a_free_request(tiny_llama) -> None:
    with Engine(tiny_llama, dtype="float32", check_integrity=True, grammar_compile_timeout_s=120) as eng:
        sched, tok = eng.scheduler, eng.tokenizer
        big = Req(rid="big", prompt_ids=tok.encode("record:"),
                  params=SamplingParams.from_dict({"json_schema": slow_schema(), "max_new_tokens": 2}))
        free = Req(rid="free", prompt_ids=tok.encode("free text"),
                   params=SamplingParams.from_dict({"max_new_tokens": FREE_TOKENS, "ignore_eos": True}))
        sched.add_request(big)
        sched.add_request(free)
        events: list[tuple[str, int, bool]] = []  # (rid, new tokens, finished), in order
        overlapped = False
        while sched.has_work:
            for out in sched.step():
                events.append((out.rid, len(out.new_ids), out.finish_reason is not None))
            if free.finished and not big.finished and big in sched.waiting:
                # The free request is done; the big one has not been admitted yet.
                assert sched.grammars.has_pending and big.grammar is None and not big.output_ids
                assert big.row is None and sched.running == []
                overlapped = True
        assert overlapped, events
        free_done = next(i for i, (rid, _, done) in enumerate(events) if rid == "free" and done)
        assert sum(n for rid, n, _ in events if rid == "free") == FREE_TOKENS
        big_first = next(i for i, (rid, n, _) in enumerate(events) if rid == "big" and n > 0)
        assert free_done < big_first, events
        assert big.finish.type == "length" and len(big.output_ids) == 2
        assert big.grammar is not None
        assert_idle_and_intact(eng)
        sched.close()
