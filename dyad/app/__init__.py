"""The application: what a user runs (the `dyad` CLI, the client, jobs, verify, eval) and the
worker process that serves a pool's commands. It sits on top of every other layer."""
