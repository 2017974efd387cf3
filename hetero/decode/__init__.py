"""The decode path: one request object (`request`), chunked prefill (`prefill`), a row's state and first token
(`state`), the stepper that makes every token (`stepper`, over `rows` with `options`), a request alone (`solo`),
the server's shared decode loop (`loop`), the draft depth (`depth`), penalties (`penalties`) and what a generation
records (`records`)."""
