"""The math_answer reward: final-answer extraction and numeric / symbolic equivalence."""

import math
import os
import signal
import threading

import pytest

from jrl.rl import math_answer as ma
from jrl.rl.math_answer import answers_equivalent, extract_final_answer, math_answer

# (completion, reference answer, expected reward); one behaviour per case.
CASES = [
    # \boxed{...}
    ("boxed_int", r"The answer is $\boxed{42}$.", "42", 1.0),
    ("boxed_nested_frac", r"So \boxed{\frac{1}{2}}", "0.5", 1.0),
    ("boxed_nested_power", r"\boxed{x^{2}+2x+1}", "(x+1)^2", 1.0),
    ("boxed_last_wins", r"First \boxed{1}, corrected: \boxed{2}", "2", 1.0),
    ("boxed_earlier_ignored", r"First \boxed{1}, corrected: \boxed{2}", "1", 0.0),
    ("boxed_before_hash", "#### 3\n" r"\boxed{4}", "4", 1.0),
    ("boxed_empty_no_answer", r"\boxed{}", "0", 0.0),
    # #### x
    ("hash", "48 / 2 = 24 clips in May.\n#### 72", "72", 1.0),
    ("hash_to_line_end", "#### 72\nI hope this helps, 5", "72", 1.0),
    ("hash_thousands", "#### 1,234", "1234", 1.0),
    ("hash_percent", "#### 50%", "50", 1.0),
    ("hash_reference_is_solution", "#### 72", "48/2 = 24\n24 + 48 = 72\n#### 72", 1.0),
    # last number
    ("last_number_int", "So she has 18 apples left.", "18", 1.0),
    ("last_number_is_last", "2 + 3 = 5, and 5 * 2 = 10", "10", 1.0),
    ("last_number_not_earlier", "2 + 3 = 5, and 5 * 2 = 10", "5", 0.0),
    ("last_number_thousands", "The total is $1,234,567.", "1234567", 1.0),
    ("last_number_negative", "The temperature drops to -5 degrees.", "-5", 1.0),
    ("last_number_decimal", "It costs about 3.50 dollars", "3.5", 1.0),
    ("last_number_fraction", "She ate 3/4", "0.75", 1.0),
    ("last_number_latex_frac", r"She ate $\frac{3}{4}$ of it", "0.75", 1.0),
    ("last_number_minus_is_operator", "10 - 3", "3", 1.0),
    # scientific notation is one number, not its exponent's digits (a completion "1e-7" scored 0
    # against the reference "1e-7": the last number read was "7")
    ("last_number_scientific_negative_exponent", "1e-7", "1e-7", 1.0),
    ("last_number_scientific", "The answer is 1.5E+2", "150", 1.0),
    ("last_number_scientific_small", "it is 2.5e-3.", "0.0025", 1.0),
    ("last_number_scientific_not_its_exponent", "The answer is 1e3", "3", 0.0),
    ("last_number_e_of_a_word_is_no_exponent", "5eggs", "5", 1.0),
    # an exponent (a unit's power) is no answer: "48 cm^2" answered 2
    ("last_number_not_a_units_power", "The area is 48 cm^2.", "48", 1.0),
    ("last_number_not_a_braced_power", "The area is 48 cm^{2}", "48", 1.0),
    ("last_number_not_a_power_of_a_quotient", "It accelerates at 5 m/s^2", "5", 1.0),
    ("last_number_after_a_power_is_taken", "so 2^10 = 1024", "1024", 1.0),
    ("last_number_not_a_negative_power", "It accelerates at 5 m s^-2", "5", 1.0),
    ("last_number_not_a_braced_negative_power", "It accelerates at 5 m s^{-2}", "5", 1.0),
    # fractions
    ("decimal_vs_fraction", r"\boxed{0.75}", "3/4", 1.0),
    ("frac_vs_decimal", r"\boxed{\frac{3}{4}}", "0.75", 1.0),
    ("dfrac_vs_slash", r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
    ("tfrac_vs_unreduced", r"\boxed{\tfrac{1}{3}}", r"\frac{2}{6}", 1.0),
    ("negative_frac", r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
    ("repeating_decimal_within_tol", r"\boxed{0.3333333}", r"\frac{1}{3}", 1.0),
    ("rounded_decimal_outside_tol", r"\boxed{0.33}", "1/3", 0.0),
    # percentages: the sign is dropped, 50% is 50
    ("percent_vs_number", r"\boxed{50\%}", "50", 1.0),
    ("number_vs_percent", r"\boxed{50}", "50%", 1.0),
    ("percent_not_fraction", r"\boxed{50\%}", "0.5", 0.0),
    # thousands separators and other formatting
    ("thousands_vs_plain", r"\boxed{1,234}", "1234", 1.0),
    ("latex_thousands", r"\boxed{1{,}000}", "1000", 1.0),
    ("thousands_not_decimal", r"\boxed{1,234}", "1.234", 0.0),
    ("short_group_not_thousands", r"\boxed{1,23}", "123", 0.0),
    ("dollar_sign", r"\boxed{\$18.00}", "18", 1.0),
    ("trailing_zero", r"\boxed{3.0}", "3", 1.0),
    ("text_wrapper", r"\boxed{\text{5}}", "5", 1.0),
    ("degrees", r"\boxed{90^\circ}", "90", 1.0),
    ("unicode_minus", "\\boxed{\u22123}", "-3", 1.0),
    ("known_unit", r"\boxed{5 \text{ cm}}", "5", 1.0),
    # equivalent expressions
    ("expanded_vs_factored", r"\boxed{2x+2}", "2(x+1)", 1.0),
    ("difference_of_squares", r"\boxed{x^2-1}", "(x-1)(x+1)", 1.0),
    ("surd_simplified", r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1.0),
    ("pi_within_tol", r"\boxed{\pi}", "3.14159265", 1.0),
    ("set_order", r"\boxed{\{1, 2\}}", r"\{2, 1\}", 1.0),
    # non-matches
    ("off_by_one", r"\boxed{41}", "42", 0.0),
    ("wrong_sign", r"\boxed{-3}", "3", 0.0),
    ("wrong_sign_frac", r"\boxed{-\frac{3}{4}}", "0.75", 0.0),
    ("different_expression", r"\boxed{2x+1}", "2(x+1)", 0.0),
    ("different_surd", r"\boxed{\sqrt{8}}", r"3\sqrt{2}", 0.0),
    ("pi_too_rough", r"\boxed{3.14}", r"\pi", 0.0),
    ("empty_completion", "", "42", 0.0),
    ("no_number", "I do not know.", "42", 0.0),
    ("garbage_latex", r"\boxed{\frac{1}{}}", "1", 0.0),
    ("garbage_brackets", r"\boxed{)(}", "0", 0.0),
    ("unclosed_boxed_falls_back", r"\boxed{\frac{3}{4}", "0.75", 1.0),
]


@pytest.mark.parametrize("completion,reference,expected", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_math_answer_table(completion, reference, expected):
    assert math_answer("prompt", completion, reference) == expected


def test_table_is_large_and_mixed():
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)
    assert sum(c[3] == 0.0 for c in CASES) >= 15


@pytest.mark.parametrize("completion", [r"\boxed{7}", "no answer here", ""])
def test_reward_is_a_finite_float(completion):
    v = math_answer("p", completion, "7")
    assert type(v) is float and math.isfinite(v) and v in (0.0, 1.0)


# ------------------------------------------------------------------ extraction

TEXT = "Work: 1 + 2 = 3.\n#### 5\nSo " r"\boxed{\frac{7}{8}}" " and then 9"


@pytest.mark.parametrize("order,expected", [
    (("boxed", "hash", "last_number"), r"\frac{7}{8}"),
    (("hash", "boxed"), "5"),
    (("last_number",), "9"),
    (("last_number", "boxed"), "9"),
    ("hash", "5"),
    (["boxed"], r"\frac{7}{8}"),
])
def test_extraction_order(order, expected):
    assert extract_final_answer(TEXT, order) == expected


def test_extraction_skips_strategies_that_find_nothing():
    assert extract_final_answer("no box, the answer is 12", ("boxed", "hash", "last_number")) == "12"
    assert extract_final_answer("no box, the answer is 12", ("boxed", "hash")) is None


def test_extraction_nested_and_escaped_braces():
    assert extract_final_answer(r"\boxed{\{1, \frac{a}{b}\}}") == r"\{1, \frac{a}{b}\}"


def test_extraction_hash_takes_the_last_marker():
    assert extract_final_answer("#### 1\n#### 2\n", "hash") == "2"


@pytest.mark.parametrize("order", [(), ("boxed", "answer_tag"), "regex"])
def test_extraction_rejects_bad_order(order):
    with pytest.raises(ValueError, match="order"):
        extract_final_answer("1", order)


def test_reward_order_option():
    completion = "#### 3\n" r"\boxed{4}"
    assert math_answer("p", completion, "3", order=["hash"]) == 1.0
    assert math_answer("p", completion, "3") == 0.0
    assert math_answer("p", r"\boxed{4}", "4", order=["hash"]) == 0.0


def test_extraction_of_long_unbalanced_input_ends():
    # 20,000 unclosed braces: a scan that backtracked per brace would not finish
    assert extract_final_answer(r"\boxed{" * 20000 + " 5") == "5"


# ------------------------------------------------------------------ equivalence guards

def test_rel_tol_option():
    assert answers_equivalent("3.1416", r"\pi", rel_tol=1e-4)
    assert not answers_equivalent("3.1416", r"\pi")
    assert answers_equivalent("1001", "1000", rel_tol=1e-3)
    assert not answers_equivalent("1002", "1000", rel_tol=1e-3)


def test_bad_options_raise():
    with pytest.raises(ValueError):
        answers_equivalent("1", "1", rel_tol=-1.0)
    with pytest.raises(ValueError):
        answers_equivalent("1", "1", timeout_s=0)


def test_pathological_input_times_out_and_checker_recovers():
    assert not answers_equivalent("9^{9^{9}}", "5", timeout_s=1.0)  # without the timeout: no end
    assert answers_equivalent("2x+2", "2(x+1)")  # a fresh worker


def test_over_long_answers_are_not_parsed():
    long = "+".join(["x"] * ma.MAX_ANSWER_CHARS)
    assert not answers_equivalent(long, "x")
    assert answers_equivalent(long, long)  # identical strings need no parsing


def test_symbolic_check_works_off_the_main_thread():
    # jrl scores rollouts on a background thread, where SIGALRM timeouts cannot work
    out = []
    t = threading.Thread(target=lambda: out.append(answers_equivalent(r"\sqrt{8}", r"2\sqrt{2}")))
    t.start()
    t.join(60)
    assert out == [True]


def test_checker_that_cannot_start_says_why(monkeypatch):
    monkeypatch.setattr(ma, "_WORKER_SOURCE", "import sys; sys.exit(1)")
    checker = ma._SymbolicChecker()
    with pytest.raises(RuntimeError, match="math-verify"):
        checker.equivalent("x", "y", 1e-6, 5.0)
    checker.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_runs_process_group_leaves_the_checker_running(sig):
    # Ctrl-C (or a scheduler's SIGTERM) signals the run's whole process group, the checker
    # too: it died while the run finished its step (a rollout under way finishes first), and
    # the comparison sent to it then scored 0 however equivalent the answers
    checker = ma._SymbolicChecker()
    try:
        assert checker.equivalent("2x+2", "2(x+1)", 1e-6, 60.0)
        worker = checker._proc
        os.kill(worker.pid, sig)
        assert checker.equivalent(r"\sqrt{8}", r"2\sqrt{2}", 1e-6, 60.0)
        assert checker._proc is worker and worker.poll() is None
    finally:
        checker.close()
