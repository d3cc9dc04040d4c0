"""The `math_answer` reward: is the final answer of a completion the reference answer?

A completion's final answer is taken from `\\boxed{...}`, a GSM8K-style `#### x` line or the
last number in the text (tried in that order by default), and compared with the reference
numerically and then symbolically, so that "0.75", "3/4" and "\\frac{3}{4}" all count, as
do "2x+2" and "2(x+1)". Symbolic equivalence is left to `math-verify` (sympy plus a LaTeX
parser) rather than hand-written parsing.

Some inputs make sympy run for hours (`9^{9^{9}}`), and math-verify's own timeout relies
on SIGALRM, which works only on the main thread, whereas jrl scores rollouts on a
background thread. The symbolic check therefore runs in one long-lived worker process
that is killed (and restarted on the next call) when a comparison exceeds `timeout_s`;
such a comparison counts as not equivalent. Plain numbers never reach the worker.

Normalisation rules, applied to both sides before comparing:
  * `$`, `\\$`, `\\(`, `\\)`, `\\[`, `\\]`, LaTeX spacing (`\\,` `\\!` `\\;` `\\:`) and
    the degree sign `^\\circ` are dropped; `\\text{..}`, `\\textbf{..}`, `\\mathrm{..}`
    and `\\mbox{..}` are unwrapped; `\\dfrac` and `\\tfrac` become `\\frac`.
  * A trailing full stop is dropped.
  * A trailing percent sign (`%` or `\\%`) is dropped: "50%" equals "50", not "0.5".
  * Thousands separators are removed where every group has three digits: "1,234" is
    1234, while "1,23" is left alone (it may be a pair).
  * Units are left to math-verify, which drops a fixed list of common ones after a
    number ("5 cm" equals "5") but not others ("18 dollars" does not equal "18").
Two plain numbers (integers, decimals, `a/b`, `\\frac{a}{b}`) are equal when they agree
within the relative tolerance `rel_tol`; anything else goes to math-verify, and two
expressions that evaluate to numbers are also accepted when within `rel_tol`.
"""

from __future__ import annotations

import atexit
import json
import math
import numbers
import os
import re
import select
import subprocess
import sys
import threading
import time
from fractions import Fraction
from typing import Sequence

STRATEGIES = ("boxed", "hash", "last_number")
DEFAULT_ORDER = STRATEGIES
# Answers longer than this (after normalisation) are never parsed: not equivalent.
MAX_ANSWER_CHARS = 500
DEFAULT_TIMEOUT_S = 5.0
# Time the worker gets to import sympy and math-verify before it counts as broken.
WORKER_START_TIMEOUT_S = 120.0
# Address-space limit of the worker process; a comparison that needs more fails.
WORKER_MEMORY_BYTES = 2 << 30

# ---------------------------------------------------------------------------- extraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASH = re.compile(r"####[ \t]*([^\n]*)")
_NUM = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"
_EXPONENT = r"(?:[eE][-+]?\d+)?"  # scientific notation: 1e-7 is one number, not a 1 and a 7
# A number not glued to a word or a decimal point before it, nor an exponent (`cm^2`,
# `cm^{2}`, `s^-2`, `s^{-2}`: a unit's power is no answer): \frac{a}{b}, a/b or a plain
# number (in scientific notation too), with an optional sign directly in front.
_NOT_AFTER = r"(?<![\w.^])(?<!\^\{)(?<!\^[-+\u2212])(?<!\^\{[-+\u2212])"
_LAST_NUMBER = re.compile(
    rf"{_NOT_AFTER}[-+\u2212]?(?:\\[dt]?frac\{{(?:{_NUM})\}}\{{(?:{_NUM})\}}"
    rf"|(?:{_NUM}){_EXPONENT}(?:/\d+(?:\.\d+)?)?)")


def _matching_braces(text: str) -> dict[int, int]:
    """Position of each `{` to the position of its `}`, in one pass; `\\{` and `\\}` are
    not structural."""
    pairs: dict[int, int] = {}
    stack: list[int] = []
    for i, c in enumerate(text):
        if c not in "{}" or (i > 0 and text[i - 1] == "\\"):
            continue
        if c == "{":
            stack.append(i)
        elif stack:
            pairs[stack.pop()] = i
    return pairs


def _last_boxed(text: str) -> str | None:
    if "\\boxed" not in text and "\\fbox" not in text:
        return None
    pairs = _matching_braces(text)
    for m in reversed(list(_BOXED.finditer(text))):
        close = pairs.get(m.end() - 1)
        if close is not None:
            return text[m.end():close].strip() or None
    return None


def _after_hash(text: str) -> str | None:
    found = _HASH.findall(text)
    return (found[-1].strip() or None) if found else None


def _last_number(text: str) -> str | None:
    found = _LAST_NUMBER.findall(text)
    return found[-1] if found else None


_EXTRACTORS = {"boxed": _last_boxed, "hash": _after_hash, "last_number": _last_number}


def check_order(order: str | Sequence[str]) -> tuple[str, ...]:
    """`order` (one strategy name or a sequence of them) as a tuple, or ValueError naming
    the strategies there are."""
    if isinstance(order, str):
        order = (order,)
    order = tuple(order)
    if not order or any(s not in _EXTRACTORS for s in order):
        raise ValueError(f"order: must be a non-empty list of {list(STRATEGIES)}, "
                         f"got {list(order)}")
    return order


def extract_final_answer(completion: str,
                         order: str | Sequence[str] = DEFAULT_ORDER) -> str | None:
    """The final answer of `completion` by the first strategy in `order` that finds one.

    Strategies: "boxed" (content of the last `\\boxed{...}` whose braces close, nested
    braces allowed), "hash" (text after the last `####` up to the end of its line) and
    "last_number" (the last number: sign, decimals, thousands separators, an exponent
    (`1e-7`), `a/b` and `\\frac{a}{b}`; not a power, the `2` of `cm^2`). Returns the answer
    as written, or None when no strategy finds one. Raises ValueError for an empty order or an
    unknown strategy.
    """
    for strategy in check_order(order):
        found = _EXTRACTORS[strategy](completion)
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------------------- normalisation

_UNWRAP = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_DROP = re.compile(r"\\?\$|\\[(\[\])]|\\[,!;:]|\^\s*\{?\s*\\circ\s*\}?")
_THOUSANDS = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d,])")
_PLAIN = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?")
_FRAC = re.compile(r"([-+]?)\\frac\{([^{}]+)\}\{([^{}]+)\}")


def _normalise(s: str) -> str:
    s = s.replace("\u2212", "-").replace("{,}", ",")
    s = _UNWRAP.sub(r"\1", s)
    s = _DROP.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    while True:
        t = s.strip().removesuffix(".").rstrip()
        t = t.removesuffix("\\%").removesuffix("%").rstrip()
        if t == s:
            break
        s = t
    return _THOUSANDS.sub(lambda m: m.group(0).replace(",", ""), s)


def _plain_value(s: str) -> Fraction | None:
    if _PLAIN.fullmatch(s):
        return Fraction(s)
    return None


def _as_number(s: str) -> Fraction | None:
    """The value of a plain number, `a/b` or `\\frac{a}{b}` (a, b plain numbers), else None."""
    sign = 1
    m = _FRAC.fullmatch(s)
    if m:
        sign = -1 if m.group(1) == "-" else 1
        num, den = m.group(2).strip(), m.group(3).strip()
    elif s.count("/") == 1:
        num, den = (part.strip() for part in s.split("/"))
    else:
        return _plain_value(s)
    a, b = _plain_value(num), _plain_value(den)
    if a is None or b is None or b == 0:
        return None
    return sign * a / b


def _close(a: Fraction, b: Fraction, rel_tol: float) -> bool:
    return a == b or abs(a - b) <= Fraction(rel_tol) * max(abs(a), abs(b))


# ---------------------------------------------------------------------------- symbolic worker

# Runs as `python -c`, so that starting it imports nothing of jrl (nor jax). Protocol: one
# JSON line [predicted, reference, rel_tol] in, one line "1" or "0" out; "ready" first.
_WORKER_SOURCE = r'''
import signal
# Ctrl-C (and a scheduler's SIGTERM) reach the run's whole process group: the run finishes
# its step first, and scores the rollout under way here; the run ends this worker (close,
# or the end of its stdin when the run dies)
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
import json, os, sys
proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
os.dup2(2, 1)  # stray prints must not reach the protocol pipe
sys.stdout = sys.stderr
try:
    import logging, resource
    limit = int(sys.argv[1])
    if limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    logging.disable(logging.CRITICAL)
    import sympy
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
except BaseException as e:
    proto.write("error " + json.dumps(f"{type(e).__name__}: {e}") + "\n")
    sys.exit(1)
config = [LatexExtractionConfig(), ExprExtractionConfig()]

def parsed(s):
    return parse("$" + s + "$", extraction_config=config, parsing_timeout=None)

def numbers_close(g, p, rel_tol):
    if not (isinstance(g, sympy.Expr) and isinstance(p, sympy.Expr)):
        return False
    if g.free_symbols or p.free_symbols:
        return False
    a, b = complex(sympy.N(g, 30)), complex(sympy.N(p, 30))
    if not all(map(lambda z: z == z and abs(z) != float("inf"), (a, b))):
        return False
    return a == b or abs(a - b) <= rel_tol * max(abs(a), abs(b))

def equivalent(predicted, reference, rel_tol):
    gold, pred = parsed(reference), parsed(predicted)
    if not gold or not pred:
        return False
    if verify(gold, pred, timeout_seconds=None):
        return True
    return numbers_close(gold[0], pred[0], rel_tol)

proto.write("ready\n")
for line in sys.stdin:
    try:
        ok = equivalent(*json.loads(line))
    except Exception:
        ok = False
    proto.write("1\n" if ok else "0\n")
'''


class _SymbolicChecker:
    """One worker process running math-verify, killed when a comparison overruns."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self._pid = os.getpid()
        atexit.register(self.close)

    def close(self) -> None:
        proc, self._proc, self._buf = self._proc, None, b""
        if proc is None or self._pid != os.getpid():
            return
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()

    def _readline(self, deadline: float) -> str | None:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:  # the worker died
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode("utf-8", "replace")

    def _start(self) -> None:
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _WORKER_SOURCE, str(WORKER_MEMORY_BYTES)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
        except OSError as e:
            raise RuntimeError(f"math_answer: cannot start the symbolic checker ({e})") from e
        line = self._readline(time.monotonic() + WORKER_START_TIMEOUT_S)
        if line != "ready":
            self.close()
            why = "no answer" if line is None else line.removeprefix("error ")
            raise RuntimeError(f"math_answer: the symbolic checker did not start ({why}); "
                               "it needs the math-verify package (pip install math-verify)")

    def equivalent(self, predicted: str, reference: str, rel_tol: float, timeout_s: float) -> bool:
        with self._lock:
            if self._pid != os.getpid():  # a forked child: leave the parent's worker alone
                self._proc, self._buf, self._pid = None, b"", os.getpid()
            if self._proc is None or self._proc.poll() is not None:
                self.close()
                self._start()
            assert self._proc is not None and self._proc.stdin is not None
            request = json.dumps([predicted, reference, rel_tol]) + "\n"
            try:
                self._proc.stdin.write(request.encode())
            except OSError:
                self.close()
                return False
            line = self._readline(time.monotonic() + timeout_s)
            if line is None:
                self.close()
                return False
            return line == "1"


_CHECKER = _SymbolicChecker()


# ---------------------------------------------------------------------------- public API

def check_limits(rel_tol: float, timeout_s: float) -> None:
    """ValueError naming the argument unless `rel_tol` is a number >= 0 and `timeout_s` a
    finite number > 0 (the longest wait for the worker: an infinite one overflows select)."""
    if isinstance(rel_tol, bool) or not isinstance(rel_tol, numbers.Real) or not rel_tol >= 0:
        raise ValueError(f"rel_tol: must be a number >= 0, got {rel_tol!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s: must be a finite number > 0, got {timeout_s!r}")


def answers_equivalent(predicted: str, reference: str, *, rel_tol: float = 1e-6,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether `predicted` and `reference` denote the same answer (see the module doc for
    the normalisation rules). Never raises for odd input: answers that are identical after
    normalisation match; otherwise unparsable, over-long (> MAX_ANSWER_CHARS) or too slow
    (> `timeout_s`) comparisons are not equivalent."""
    check_limits(rel_tol, timeout_s)
    p, r = _normalise(predicted), _normalise(reference)
    if not p or not r:
        return False
    if p == r:
        return True
    if len(p) > MAX_ANSWER_CHARS or len(r) > MAX_ANSWER_CHARS:
        return False
    a, b = _as_number(p), _as_number(r)
    if a is not None and b is not None:
        return _close(a, b, rel_tol)
    return _CHECKER.equivalent(p, r, float(rel_tol), float(timeout_s))


def reference_answer(answer: str) -> str:
    """The reference to compare with: the last `\\boxed{}` or `####` answer in `answer` when
    it has one (a full worked solution, as in GSM8K), else `answer` itself."""
    return extract_final_answer(answer, ("boxed", "hash")) or answer


def math_answer(prompt: str, completion: str, answer: str, *,
                order: str | Sequence[str] = DEFAULT_ORDER, rel_tol: float = 1e-6,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """Reward: 1.0 when the completion's final answer (by `order`, see
    `extract_final_answer`) is equivalent to the reference answer, else 0.0."""
    del prompt
    predicted = extract_final_answer(completion, order)
    if predicted is None:
        return 0.0
    ok = answers_equivalent(predicted, reference_answer(answer), rel_tol=rel_tol,
                            timeout_s=timeout_s)
    return 1.0 if ok else 0.0
