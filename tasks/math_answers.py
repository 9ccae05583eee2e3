"""The ``math`` verifier: the final answer read off a completion and compared with the task's,
as plain numbers first, then as mathematics (``math-verify``)."""

from __future__ import annotations

import logging
import math
import re
import threading
from fractions import Fraction

from conveyor.contracts import Feedback, Task
from tasks.verdict import Verdict, VerifierError

_BOXED = re.compile(r"\\boxed\s*\{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _boxed(text: str) -> str | None:
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    i, depth, out = matches[-1].end(), 1, []
    while i < len(text):
        ch = text[i]
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return "".join(out)
        out.append(ch)
        i += 1
    return None


def extract_answer(text: str) -> str | None:
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    for pattern in (r"####\s*(.+)", r"(?i)answer\s*(?:is\s*:?|:)\s*(.+)"):
        m = list(re.finditer(pattern, text))
        if m:
            return m[-1].group(1).strip().splitlines()[0]
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def normalise(answer: str) -> str:
    s = answer.strip().strip(".").replace("\\!", "").replace("$", "").replace("\\%", "%")
    s = re.sub(r"\\(?:text|mathrm)\{([^}]*)\}", r"\1", s)
    s = re.sub(r"\\d?frac\{([^}]*)\}\{([^}]*)\}", r"(\1)/(\2)", s)
    s = s.replace("\\left", "").replace("\\right", "").replace(" ", "")
    while len(s) > 1 and s[0] == "{" and s[-1] == "}":
        s = s[1:-1]
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s.lower()


def as_number(s: str) -> float | None:
    s = s.rstrip("%")
    s = re.sub(r"^\((-?[\d.]+)\)/\((-?[\d.]+)\)$", r"\1/\2", s)
    try:
        return float(Fraction(s))
    except (ValueError, ZeroDivisionError):
        return None


# Off the main thread math-verify's time limit is off by design (symbolically_equal): its warning
# saying so on every call is noise.
logging.getLogger("math_verify").setLevel(logging.ERROR)
_TOWER = re.compile(r"\^[^^]*\^|\^\s*\{?\s*\d{4,}|!\s*!")  # power towers, huge exponents, double factorials


def symbolically_equal(want: str, got: str) -> bool:
    """Whether two answers are the same mathematics (``math-verify``: fractions, radicals, sets,
    intervals, LaTeX), for answers the numeric check cannot compare.

    math-verify bounds its own time with SIGALRM, which only the main thread may use; elsewhere
    (the in-process scorer's thread) an answer that could make sympy run away (a power tower, a
    huge exponent, an answer over 200 characters) is not compared at all, and judged unequal."""
    main = threading.current_thread() is threading.main_thread()
    if not main and (len(want) > 200 or len(got) > 200 or _TOWER.search(want) or _TOWER.search(got)):
        return False
    from math_verify import parse, verify

    timeout = 5 if main else None
    as_latex = lambda s: s if "$" in s or "\\(" in s else f"${s}$"  # noqa: E731
    try:
        gold = parse(as_latex(want), parsing_timeout=timeout)
        answer = parse(as_latex(got), parsing_timeout=timeout)
        return bool(gold) and bool(answer) and bool(verify(gold, answer, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - an answer math-verify cannot read is not equal
        return False


def judge_math(task: Task, completion: str) -> Verdict:
    data = task.verifier.data
    if "answer" not in data:
        raise VerifierError(f"task {task.task_id}: math verifier needs data.answer")
    got = extract_answer(completion)
    if got is None:
        return Verdict(0.0, "fail", Feedback(message="no final answer found", text=completion[-200:]))
    want_s, got_s = normalise(str(data["answer"])), normalise(got)
    if want_s == got_s:
        return Verdict(1.0, "pass")
    want_n, got_n = as_number(want_s), as_number(got_s)
    tol = float(data.get("tolerance", 1e-6))
    if want_n is not None and got_n is not None and math.isclose(want_n, got_n, rel_tol=tol, abs_tol=tol):
        return Verdict(1.0, "pass")
    if want_n is None or got_n is None:  # not two plain numbers: equal as mathematics?
        if symbolically_equal(str(data["answer"]), got):
            return Verdict(1.0, "pass")
    return Verdict(0.0, "fail", Feedback(message=f"answer {got!r} is not correct", text=completion[-200:]))
