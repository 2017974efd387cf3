"""Program loaders for the ANE lane's worker process (`hetero.backends.ane_worker`, given as "ane_faults:NAME")
that stand in for Core ML's `CompiledMLModel.predict` misbehaving: each runs the real reference executor, except
that at the worker's Nth job (HETERO_TEST_FAULT_AT, default 3) the worker process really dies (SIGKILL to
itself), hangs (sleeps an hour) or returns NaN outputs."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from hetero.backends.reference_executor import ReferenceExecutor

_JOBS = [0]


def _faulty(fault):
    def load(path, function=None):
        real = ReferenceExecutor(path, function)

        def run(inputs: dict) -> dict:
            _JOBS[0] += 1
            if _JOBS[0] == int(os.environ.get("HETERO_TEST_FAULT_AT", "3")):
                return fault(real, inputs)
            return real(inputs)

        return run

    return load


def _die(real, inputs):
    os.kill(os.getpid(), signal.SIGKILL)


def _hang(real, inputs):
    time.sleep(3600)


def _nan(real, inputs):
    return {name: np.full_like(a, np.nan) for name, a in real(inputs).items()}


dies, hangs, garbage = _faulty(_die), _faulty(_hang), _faulty(_nan)
