"""Continuous batching with radix prefix reuse, chunked prefill and retraction: the
`scheduler.Scheduler` over `request.Req`s, set by `config.SchedulerConfig`. The package
imports none of its modules, so that `config` imports without torch."""
