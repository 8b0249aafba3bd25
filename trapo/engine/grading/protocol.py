"""The wire between the Math-Verify processes: length-prefixed pickles one way, result lines back.

Both pipes speak it: the trainer's `verifier.MathVerifier` to the supervisor (`supervisor`, on its
stdin and stdout; the trainer writes the same framing in `verifier._SupervisorProcess.send`), and the
supervisor to each executor it forks (`executor`). A message is a 4-byte big-endian length,
then a pickle.

Protocol on the supervisor's stdin/stdout:
- after the warm-up, the line `ready`;
- a restore: a pickled dict {"restore": {"answers": {answer: timeout}, "pairs": [((gold, pred), timeout)]}},
  the memory of what exhausted a timeout (a replaced supervisor's, or a checkpoint's); answered `restored`;
- a request: 4-byte big-endian length, then a pickled dict: `items`, a list
  of (gold, pred) answer strings (boxed contents), pred None to only parse
  gold; `units`, one int per item: the items of a unit are queued on one
  executor, whose parse cache then serves them all; `timeout`, seconds per
  item; `deadline`, a `time.monotonic()` value or None (that clock is
  system-wide, the same in the parent and the supervisor);
- per item, as soon as it is settled, a line `<index> <code>`, code one of
  1 equal, 0 not equal, r parsed (pred None; `r<real>,<imag>` with the answer's probe value where it is a
  float-range number, `rm<mantissa>,<exponent>` where it is a real beyond that range: `encode_value`),
  t the comparison of the two
  (already parsed) answers timed out, g / p parsing the gold / pred timed
  out, b cut by the deadline, f failed (executors died on it twice: undecided) (see `judge.Verdict`);
  a `*` after g, p or t says the supervisor remembered the answer or pair now (the parent mirrors it).

Between the supervisor and an executor: per item, a message (gold, pred, seconds to the soft alarm,
whether to clear the parse cache) one way, and one line back, its code: 1, 0, r, or t when the soft
alarm rang (the supervisor then blames the answer or the pair by the phase byte they share).
"""

from __future__ import annotations

import os
import pickle
import struct


def _read_exact(fd: int, size: int) -> bytes | None:
    chunks = []
    while size:
        data = os.read(fd, size)
        if not data:
            return None
        chunks.append(data)
        size -= len(data)
    return b"".join(chunks)


def _read_message(fd: int):
    header = _read_exact(fd, 4)
    if header is None:
        return None
    payload = _read_exact(fd, struct.unpack(">I", header)[0])
    return None if payload is None else pickle.loads(payload)


def _write_message(fd: int, obj) -> None:
    payload = pickle.dumps(obj)
    data = memoryview(struct.pack(">I", len(payload)) + payload)
    while data:
        data = data[os.write(fd, data) :]


def encode_value(value) -> bytes:
    """A parsed answer's probe value for its `r` line: exact float reprs (no spaces); a real number beyond
    float range (an mpmath mpf, 9^{9^9}) as `m<mantissa>,<exponent>`, exactly; nothing where it is None or
    a complex number beyond float range (its comparisons stay in the executors)."""
    if isinstance(value, complex):
        return f"{value.real!r},{value.imag!r}".encode()
    parts = getattr(value, "_mpf_", None)  # mpmath's (sign, mantissa, exponent, bits): value = ±mantissa * 2^exponent
    if parts is not None and parts[1]:
        sign, mantissa, exponent, _ = parts
        return f"m{-mantissa if sign else mantissa},{exponent}".encode()
    return b""


def decode_value(payload: str):
    """`encode_value` read back: the same complex number, or mpmath number; None for an empty payload."""
    if not payload:
        return None
    if payload.startswith("m"):
        import mpmath  # only where an answer was that large: a vote over exponent towers

        mantissa, exponent = (int(x) for x in payload[1:].split(","))
        return mpmath.mpf(mpmath.libmp.from_man_exp(mantissa, exponent))
    real, imag = payload.split(",")
    return complex(float(real), float(imag))
