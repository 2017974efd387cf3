"""Pipeline parallelism across ranks started by `mlx.launch` (ring backend): the backbone's layers split by the
planner (`hetero.planner.hosts.split_layers`), each rank loading only its own tensors, hidden states passed with
`mx.distributed.send`/`recv`, prefill pipelined by chunk, decoding and MTP rounds led by the last rank.

    group.py     joining the ring (under a watchdog) and the Link: send/recv to neighbours, broadcasts, errors
    watchdog.py  a deadline kept by a separate process: a hung peer or a missing one ends the rank in one line
    shard.py     which tensors a rank owns; loading only those, shard by shard
    stage.py     a rank's share as a pipeline stage (on the last rank, a stand-in for `Model`)
    request.py   `Request`, one request as rank 0 broadcasts it to every rank (JSON on the wire)
    rounds.py    one request: pipelined prefill, the last rank leading decoding, the others following
    outputs.py   a request's JSON constraint and logprobs on the last rank, the logprob rows sent to rank 0
    runtime.py   `PipelineEngine` on rank 0, `serve` on the others
    command.py   `hetero run` under mlx.launch (and the start every pipelined command shares)
    serve_command.py  `hetero serve` under mlx.launch: rank 0 serves HTTP on the pipelined engine
"""

from hetero.distributed.group import DEFAULT_TIMEOUT_S, Link, PeerLost, connect, launched

__all__ = ["DEFAULT_TIMEOUT_S", "Link", "PeerLost", "connect", "launched"]
