"""Math correctness through HuggingFace's `math-verify`: the completion's final answer (a
`\\boxed{}`, a LaTeX expression, or the last number) is parsed to sympy and compared with the
ground truth by value, so `\\frac{1}{2}`, `1/2` and `0.5` all match `0.5`.

The answer must be written, not left to compute: math-verify evaluates what it reads, so `7 + 1`,
`\\boxed{7+1}` or a completion cut off at "she sold 48 + 24" would equal 8 or 72, and a policy could
earn the reward by copying the question's operands. A final answer that combines written numbers by
+, -, x, a whole power (2^{10}) or a division that comes out whole (48/2) is wrong unless the ground
truth is written that way too (`written_arithmetic`). A sign, a fraction (1/2, \\frac{7}{2}), a root,
pi, scientific notation (3 \\times 10^5) and expressions in variables (x^2+2x) are values as written.
A worked equation is judged by what follows its last `=` (`48 + 24 = 72` is 72), as math-verify
compares it. math-verify hands LaTeX divisions back evaluated (\\frac{48}{2}, \\boxed{48/2} and
48 \\div 2 read as 24), so those are read from the text it matched (`WHOLE_DIVISION`).

Before math-verify reads them, the completion and the ground truth are put in the forms it reads
(`normalize`): a Unicode minus (U+2212) as "-" (math-verify skipped it and took the number
before), digits of another script (full-width `７２`, Arabic-Indic `٧٢`; read as nothing) and the
full-width forms of ASCII (`＋`, `．`, `＝`) as ASCII, superscript digits as a power (`10⁶`, `x²`: read as
the text `x²`, equal to nothing), digit groups split by a thin space (`10\\,000`, U+202F, U+00A0; and a plain space in a ground
truth or a `\\boxed{}`) joined (read as 10 x 0), a mixed number (`5 1/2`) as the fraction it is (11/2;
read as (5+1)/2), and a `\\boxed{50\\%}` as `\\boxed{50}\\%` (not read at all). A completion with
GSM8K's `#### <number>` (the task's prompt asks for it) and no `\\boxed{}` is judged by the number after
the last such `####`, not by the last number it wrote (`#### 72 (over 2 months)` is 72, not 2); a
worked equation there by what follows its last `=` on that line (`#### 48 + 24 = 72` is 72, not its first
number 48), and arithmetic with no `=` (`#### 48 + 24`) as written arithmetic; a markdown heading
(`#### 1. Setup`) is no answer.

math-verify's own timeouts use SIGALRM, which works only in the main thread. Rewards run in a
worker thread (grpo.rewards cuts them off with `reward.timeout_s`), so there its timeouts are off;
evaluation (`Task.is_correct`) runs in the main thread and keeps them (5 s per parse or compare). A parse or a
comparison that runs out of time reads as nothing or as unequal there, so it is tried once more (`_timed`);
out of time twice, a ground truth is refused and a completion is `Unjudged` (evaluation counts it wrong and
says how many), never silently wrong.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
import unicodedata
from decimal import Decimal

from grpo.errors import Unjudged

TIMEOUT_S = 5  # math-verify's own limit, main thread only
# a `$` that opens LaTeX math; `\$` is a dollar sign (MATH's `\$18.90`), not a delimiter
MATH_DELIMITER = re.compile(r"(?<!\\)\$")


class _NoTimeoutNotice(logging.Filter):
    """Drops math-verify's notice that its timeouts are off (on every call): that is deliberate here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutNotice())


# an operation after a number: `=`, an operator with a number after it (`72 - that is`, `72** (over 2
# months)` are no arithmetic: a dash before words, markdown bold), or a power (`10^{6}`, which plain text reads as
# 10; not a bare `10^-3`, which LaTeX reads as 10 and plain text rightly)
_OPERATION = r"[ \t]*(?:=|(?:[-+*/x×÷]|\\times|\\cdot)[ \t]*\(?[ \t]*\\?\$?[0-9]|\^[ \t]*(?:\{[ \t]*-?)?[0-9])"
TIMES = re.compile(r"(?<=[0-9)])[ \t]*[x×][ \t]*(?=[0-9(])")  # a times sign between numbers: 5 x 4, 5×4
# GSM8K's final answer (verl's pattern): group 1 a number, not a markdown heading (`#### 1. Setup`, `#### 2) Solve`)
# nor the start of a number written otherwise (`#### 1 000 000`, `#### 10^-3`: read whole); group 2 a line
# of arithmetic (`#### 48 + 24 = 72`, `#### 1/2`, `#### 10^{6}`), whose first number is no answer
HASHES = re.compile(r"####[ \t]*(?:\\?\$?[ \t]*(-?[0-9][0-9,]*(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)"
                    rf"(?![0-9,.]*(?:\.[ \t]+[A-Za-z]|\)[ \t]+[A-Za-z]|[/^]| [0-9]|{_OPERATION}))"
                    rf"|(\\?\$?[ \t]*-?[0-9][0-9,.]*{_OPERATION}[^\n]*))")
# a sign before a dollar sign (`#### -$5`), moved after it, where HASHES reads one (`#### $-5`): nothing was read, so -5 scored 0
SIGN_BEFORE_DOLLAR = re.compile(r"(####[ \t]*)-[ \t]*(\\?\$)")
_SEP = r"(?:\\,|\\!|\\ |~|\{,\}|[\u00a0\u2009\u202f])"  # LaTeX and Unicode thin spaces between digit groups
THIN_GROUPS = re.compile(rf"(?<![\d.])\d{{1,3}}(?:{_SEP}\d{{3}})+(?![\d])")
SPACED_GROUPS = re.compile(rf"(?<![\d.])\d{{1,3}}(?:(?:{_SEP}| )\d{{3}})+(?![\d])")
MIXED = re.compile(r"(?<![\d./,])(\d+) (\d+)/(\d+)(?![\d./])")
BOXED_PERCENT = re.compile(r"\\boxed\{([^{}]*?)\s*\\%\s*\}")
BOXED_FLAT = re.compile(r"\\boxed\{([^{}]*)\}")  # a \boxed{} without nested braces
# a division of two whole numbers as math-verify's LaTeX reading matched it (\dfrac, \tfrac: \frac by then), which
# it hands back evaluated (48/2 as 24): numerator, denominator
SUPERSCRIPT_DIGITS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻", "0123456789-")
SUPERSCRIPT = re.compile("⁻?[⁰¹²³⁴⁵⁶⁷⁸⁹]+")
ARABIC_SEPARATORS = {"\u066b": ".", "\u066c": ","}  # ٫ ٬
# a number in E notation, as Python and JSON write one (str(1e-05), a JSON 1e5): math-verify reads a lowercase
# `e` as Euler's number (1e5 as 5e, 1e-05 as e - 5)
E_NOTATION = re.compile(r"\s*[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+\s*")
# a sign inside either part is still a whole division: math-verify hands \boxed{-48/2} back as \frac{-48}{2}
WHOLE_DIVISION = re.compile(r"\\frac\{\s*-?\s*(\d+)\s*\}\{\s*-?\s*(\d+)\s*\}|(?<![\d.])(\d+)\s*(?:/|\\div)\s*-?\s*(\d+)(?![\d.])")


def _power(exponent: str, latex: bool) -> str:
    """A superscript's exponent as math-verify reads it: `^12` in text and LaTeX alike; a negative one
    braced in LaTeX (`\\boxed{10^-3}` reads as nothing) and bare in text (`10^{-3}` in prose reads as 10)."""
    if exponent.startswith("-") and latex:
        return "^{" + exponent + "}"
    return "^" + exponent


def _ascii_forms(text: str) -> str:
    """Digits of any script (Unicode's decimal digits: full-width, Arabic-Indic, Devanagari...) as ASCII
    digits, full-width ASCII (U+FF01-U+FF5E) as ASCII, the Arabic decimal and thousands separators as
    `.` and `,`; a run of superscript digits as a power (`x²` as `x^2`), not as digits (`x²` is not `x2`)."""
    if text.isascii():
        return text
    latex = "\\boxed" in text or MATH_DELIMITER.search(text) is not None
    text = SUPERSCRIPT.sub(lambda m: _power(m.group(0).translate(SUPERSCRIPT_DIGITS), latex), text)
    out = []
    for ch in text:
        if "\uff01" <= ch <= "\uff5e":
            ch = chr(ord(ch) - 0xFEE0)
        elif not ch.isascii() and unicodedata.category(ch) == "Nd":
            ch = str(unicodedata.decimal(ch))
        out.append(ARABIC_SEPARATORS.get(ch, ch))
    return "".join(out)


def _join_groups(match: re.Match) -> str:
    return re.sub(_SEP + "| ", "", match.group(0))


def _mixed(match: re.Match) -> str:
    whole, num, den = (int(g) for g in match.groups())
    return f"{whole * den + num}/{den}" if 0 < num < den else match.group(0)


def hashes_answer(text: str) -> str | None:
    """What math-verify reads of the last `####` that holds an answer (None: none does): its number; of a
    line of arithmetic, the number after the line's last `=` (`#### 48 + 24 = 72 (over 2 months)`: 72), or
    the line as LaTeX math where no number follows one (`#### 48 + 24`: written arithmetic, so no answer)."""
    found = HASHES.findall(SIGN_BEFORE_DOLLAR.sub(r"\1\2-", text))
    if not found:
        return None
    number, worked = found[-1]
    if number:  # E notation written out: math-verify reads `#### 1e6` as its first number, 1
        number = number.replace(",", "")
        return format(Decimal(number), "f") if E_NOTATION.fullmatch(number) else number
    if "=" in worked and (result := hashes_answer("#### " + worked.rsplit("=", 1)[1])) is not None:
        return result
    if "$" in worked:
        return worked
    # as LaTeX math: math-verify reads plain text from its last number-like term, so `1.5 \times 10^6` read as
    # 10^6 (1000000 scored, 1500000 not); an `x` or `×` between numbers is a times sign, not the variable x
    return "$" + TIMES.sub(r" \\times ", worked.replace("÷", "\\div ")) + "$"


def normalize(text: str, ground_truth: bool = False) -> str:
    """The forms math-verify reads (the module's docstring). A plain space joins digit groups only in a
    ground truth and inside a `\\boxed{}`: in a completion's prose "3 100-dollar bills" is two numbers."""
    text = _ascii_forms(text.replace("\u2212", "-"))
    if ground_truth and E_NOTATION.fullmatch(text):  # a ground truth that is one number: written out (1e5 as 100000)
        return format(Decimal(text.strip()), "f")
    if not ground_truth and "\\boxed" not in text and (answer := hashes_answer(text)) is not None:  # a \boxed{} wins
        return answer
    groups = SPACED_GROUPS if ground_truth else THIN_GROUPS
    text = groups.sub(_join_groups, text)
    if not ground_truth:
        text = BOXED_FLAT.sub(lambda m: "\\boxed{" + SPACED_GROUPS.sub(_join_groups, m.group(1)) + "}", text)
    text = MIXED.sub(_mixed, text)
    return BOXED_PERCENT.sub(r"\\boxed{\1}\\%", text)


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _timed(call):
    """`call(timeout)`'s answer, and whether it ran out of math-verify's time twice. Past its timeout a parse
    reads nothing and a comparison answers False (math-verify logs a warning), so a falsy answer that took the
    whole timeout is tried once more: a process's first parse warms sympy and the LaTeX grammar up, and a
    loaded machine can hold a plain `(-1,2)` past 5 s."""
    timeout = _timeout()
    for _ in range(2):
        start = time.monotonic()
        answer = call(timeout)
        timed_out = not answer and timeout is not None and time.monotonic() - start >= timeout
        if not timed_out:
            break
    return answer, timed_out


def _timed_parse(text: str) -> tuple[list, bool]:
    from math_verify import parse  # local: math_verify is heavy (sympy); grpo.config imports the reward registry

    return _timed(lambda timeout: parse(text, parsing_timeout=timeout))


@functools.lru_cache(maxsize=65536)  # each ground truth is compared with G completions per step
def _parse_gold(answer: str) -> tuple:
    answer = normalize(answer, ground_truth=True)
    delimited = MATH_DELIMITER.search(answer) or "\\boxed" in answer
    gold, timed_out = _timed_parse(answer if delimited else f"${answer}$")
    if timed_out:  # raised, so not cached: a later call tries again
        raise ValueError(f"math-verify ran out of its {TIMEOUT_S} s twice parsing the ground truth {answer!r} (a machine "
                         "too loaded, or an answer too long to read): nothing was read from it")
    if not gold:
        raise ValueError(f"math-verify could not parse the ground truth {answer!r}")
    return tuple(gold)


def parse_gold(answer: str) -> list:
    """The ground truth `answer` (plain, `$`-delimited or `\\boxed{}` LaTeX) as math-verify reads it;
    ValueError when it reads nothing (a task checks its held-out answers with this when it is built)."""
    return list(_parse_gold(answer))


def _nodes(expr):
    """Every sub-expression of a parsed answer, a matrix's entries included (a matrix is not a sympy tree)."""
    if hasattr(expr, "tolist") and not hasattr(expr, "args"):
        for row in expr.tolist():
            for entry in row:
                yield from _nodes(entry)
        return
    yield expr
    for arg in getattr(expr, "args", ()):
        yield from _nodes(arg)


def _written_number(arg, node) -> bool:
    """A number written as a term of `node`: 7, and in a sum a subtracted one (48 - 24 reads as
    48 + (-1) x 24); the -1 of a product is a sign (-3), not a number written."""
    if arg.is_Number:
        return not (node.is_Mul and arg == -1)
    return bool(node.is_Add and arg.is_Mul and len(arg.args) == 2 and arg.args[0] == -1 and arg.args[1].is_Number)


def _computes(node) -> bool:
    """Whether one node joins written numbers by an operation: 7 + 1, 48 - 24, 3 \\cdot 6, 2^{10}, 48/2."""
    if node.is_Add or node.is_Mul:
        numbers = [a for a in node.args if _written_number(a, node)]
        if len(numbers) >= 2:
            return True
        divisors = [a.base for a in node.args if a.is_Pow and a.base.is_Number and a.exp == -1]
        if node.is_Mul and numbers and divisors:  # a/b: a fraction, unless it comes out whole
            quotient = numbers[0]
            for d in divisors:
                quotient = quotient / d
            return quotient.is_Integer
        return False
    if node.is_Pow:  # 10^k is scientific notation; a root or 1/b is a value
        return node.base.is_Number and node.exp.is_Integer and node.exp > 1 and node.base != 10
    return False


def answer_side(value):
    """The part of a parsed answer math-verify compares: of a relation (`48 + 24 = 72`, read as
    Eq(48 + 24, 72)) or a chain of them (`x = 2 + 3 = 5`), the last one's right-hand side; the working
    on the left is not the answer."""
    if type(value).__name__ == "And":
        relations = getattr(value, "_unsorted_args", value.args)
        if relations and all(getattr(r, "is_Relational", False) for r in relations):
            value = relations[-1]
    return value.rhs if getattr(value, "is_Relational", False) else value


def whole_division(text: str) -> bool:
    """Whether the matched text divides a whole number by one that divides it (48/2, \\frac{48}{2},
    48 \\div 2): an operation, where \\frac{7}{2} is a value. Of a relation, its last right-hand side."""
    last = text.rsplit("=", 1)[-1]
    for m in WHOLE_DIVISION.finditer(last):
        a, b = (int(g) for g in (m.groups()[:2] if m.group(1) else m.groups()[2:]))
        if b and a % b == 0:
            return True
    return False


def written_arithmetic(parsed: list) -> bool:
    """Whether math-verify's reading of an answer ([sympy value, matched text], or text alone) is an
    operation on written numbers rather than a value (this module's docstring)."""
    return any(whole_division(value) if isinstance(value, str) else
               any(_computes(node) for node in _nodes(answer_side(value)) if hasattr(node, "is_Add"))
               for value in parsed)


def is_equivalent(completion: str, answer: str) -> bool:
    """True when math-verify finds the completion's final answer equal to `answer` (plain or LaTeX),
    written as a value (not `7 + 1` for 8, unless `answer` is written so); `Unjudged` when it ran out of
    its time twice (main thread only)."""
    from math_verify import verify  # local: as in _timed_parse

    gold = parse_gold(answer)
    pred, timed_out = _timed_parse(normalize(completion))
    if timed_out:
        raise Unjudged(f"math-verify ran out of its {TIMEOUT_S} s twice reading the completion's answer")
    if not pred or (written_arithmetic(pred) and not written_arithmetic(gold)):
        return False
    equal, timed_out = _timed(lambda timeout: verify(gold, pred, timeout_seconds=timeout))
    if timed_out:
        raise Unjudged(f"math-verify ran out of its {TIMEOUT_S} s twice comparing the completion's answer with {answer!r}")
    return equal


def math_verify(completions: list[str], samples: list, **_) -> list[float]:
    """1.0 when the completion's final answer equals the sample's answer by value, else 0.0."""
    return [float(is_equivalent(c, s.answer)) for c, s in zip(completions, samples)]
