"""The HTTP server: three processes (HTTP + tokenizer manager, scheduler, detokenizer)
connected by ZeroMQ. Start it with `sprig serve --model PATH` or
`sprig.runtime.server.launch.launch_server`."""
