"""Reward functions: built-ins, `module:function` loading, weighted sums, errors."""

import concurrent.futures
import re

import numpy as np
import pytest

from jrl.config import ConfigError
from jrl.rl.rewards import (
    RewardError,
    RewardModel,
    RewardSpec,
    exact_match,
    format_check,
    resolve_reward,
    reward_specs_from_config,
)


def user_module(tmp_path, monkeypatch, name: str, source: str) -> None:
    """Writes `source` as the module `name` on sys.path, as a user's reward file."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_exact_match_compares_stripped_completion_to_answer():
    assert exact_match("1+2=", " 3 ", "3") == 1.0
    assert exact_match("1+2=", "4", "3") == 0.0
    assert exact_match("1+2=", "33", "3") == 0.0


@pytest.mark.parametrize("pattern, completion", [(r"<a>(.*?)</a>|final: [0-9]+", "final: 42"),
                                                 (r"answer(?: is (\d+))?", "the answer: 42")])
def test_exact_match_scores_0_when_the_first_group_took_no_part_in_the_match(pattern, completion):
    # the group's None reached .strip(): an AttributeError that stopped the run
    assert exact_match("q", completion, "42", pattern=pattern) == 0.0


def test_exact_match_with_pattern_uses_first_group():
    assert exact_match("q", "so the answer is <a>42</a>.", "42", pattern=r"<a>(.*?)</a>") == 1.0
    assert exact_match("q", "no tags 42", "42", pattern=r"<a>(.*?)</a>") == 0.0


def test_format_check_requires_full_match():
    assert format_check("q", "123", "", pattern=r"[0-9]+") == 1.0
    assert format_check("q", "12a", "", pattern=r"[0-9]+") == 0.0


def test_reward_model_sums_weighted_terms_and_reports_each():
    model = RewardModel([RewardSpec("exact_match", 1.0),
                         RewardSpec("format_check", 0.5, {"pattern": "[0-9]+"})])
    total, terms = model(["a", "b", "c"], ["12", "13", "x"], ["12", "12", "12"])
    np.testing.assert_allclose(total, [1.5, 0.5, 0.0])
    np.testing.assert_allclose(terms["exact_match"], [1.0, 0.0, 0.0])
    np.testing.assert_allclose(terms["format_check"], [1.0, 1.0, 0.0])


def test_a_reward_term_named_mean_or_std_does_not_shadow_the_totals_statistics(tmp_path, monkeypatch):
    # its mean is logged as reward_<name>: reward_mean / reward_std are the total's
    user_module(tmp_path, monkeypatch, "stat_rewards_mod", "def mean(p, c, a):\n    return 1\n\ndef std(p, c, a):\n"
                                                           "    return np.bool_(True)\n\nimport numpy as np\n")
    model = RewardModel([RewardSpec("stat_rewards_mod:mean"), RewardSpec("stat_rewards_mod:std")])
    total, terms = model(["p"], ["c"], ["a"])
    assert model.names == ["mean_0", "std_1"] and total.tolist() == [2.0]  # a numpy bool counts as 1


def test_user_reward_is_imported_from_module_colon_function(tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch, "my_rewards_mod", "def brevity(prompt, completion, answer, limit=3):\n"
                                                         "    return 1.0 if len(completion) <= limit else -1.0\n")
    specs = reward_specs_from_config([{"fn": "my_rewards_mod:brevity", "weight": 2.0,
                                       "kwargs": {"limit": 2}}])
    total, terms = RewardModel(specs)(["p", "p"], ["ab", "abc"], ["", ""])
    np.testing.assert_allclose(total, [2.0, -2.0])
    assert list(terms) == ["brevity"]


@pytest.mark.parametrize("name,msg", [
    ("exact", "unknown built-in reward 'exact'"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("math:no_such_fn", "module 'math' has no function 'no_such_fn'"),
    ("math:pi", "'math:pi' is not callable"),
])
def test_bad_reward_names_give_clear_errors(name, msg):
    with pytest.raises(ConfigError, match=msg):
        resolve_reward(name, "rewards[0].fn")


@pytest.mark.parametrize("name", ["project/my_rewards.py:score", "project/my_rewards:score"])
def test_a_reward_named_by_its_file_path_says_to_name_the_module(name):
    # before: "cannot import module 'project/my_rewards.py' (No module named ...)", with no word of the fix
    with pytest.raises(ConfigError) as e:
        resolve_reward(name, "rewards[0].fn")
    module = name.partition(":")[0]
    assert str(e.value) == (f"rewards[0].fn: cannot import module {module!r}: that is a file path; name the module, "
                            f"'my_rewards:score', with the directory that holds it on PYTHONPATH (or run from there)")


def test_reward_module_that_fails_to_import_names_the_field_module_and_error(tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch, "broken_rewards_mod", "def f(prompt, completion, answer):\n    return 1.0 +\n")
    with pytest.raises(ConfigError) as e:
        resolve_reward("broken_rewards_mod:f", "rewards[0].fn")
    assert str(e.value) == ("rewards[0].fn: importing module 'broken_rewards_mod' raised "
                            "SyntaxError: invalid syntax (broken_rewards_mod.py, line 2)")


def test_a_reward_module_that_exits_on_import_is_a_config_error_naming_it(tmp_path, monkeypatch):
    # argparse at a module's top level: its SystemExit ended jrl with a usage line not its own
    user_module(tmp_path, monkeypatch, "argv_rewards_mod", "import sys\nsys.exit(2)\n"
                                                           "def f(prompt, completion, answer):\n    return 1.0\n")
    with pytest.raises(ConfigError) as e:
        resolve_reward("argv_rewards_mod:f", "rewards[0].fn")
    assert str(e.value) == "rewards[0].fn: importing module 'argv_rewards_mod' raised SystemExit: 2"


def test_a_builtin_pattern_that_is_not_a_regex_is_refused_with_the_config():
    with pytest.raises(ConfigError) as e:
        RewardModel([RewardSpec("exact_match", 1.0, {"pattern": "<a>(["})])
    assert str(e.value) == ("rewards[0].kwargs.pattern: not a valid regular expression (unterminated "
                            "character set at position 4), got '<a>(['")


def test_an_unknown_math_answer_strategy_is_refused_with_the_config():
    with pytest.raises(ConfigError) as e:
        RewardModel([RewardSpec("exact_match", 1.0), RewardSpec("math_answer", 1.0, {"order": ["boxed", "last"]})])
    assert str(e.value) == ("rewards[1].kwargs.order: must be a non-empty list of ['boxed', 'hash', "
                            "'last_number'], got ['boxed', 'last']")


@pytest.mark.parametrize("kwargs, message", [
    ({"rel_tol": -1}, "rel_tol: must be a number >= 0, got -1"),
    ({"rel_tol": "tight"}, "rel_tol: must be a number >= 0, got 'tight'"),
    ({"timeout_s": 0}, "timeout_s: must be a finite number > 0, got 0"),
    ({"timeout_s": float("inf")}, "timeout_s: must be a finite number > 0, got inf"),
])
def test_a_math_answer_tolerance_or_timeout_that_fails_every_call_is_refused_with_the_config(kwargs, message):
    # it failed at the first completion holding a number, after the warm start had trained (inf: an OverflowError)
    with pytest.raises(ConfigError) as e:
        RewardModel([RewardSpec("exact_match"), RewardSpec("math_answer", 1.0, kwargs)])
    assert str(e.value) == f"rewards[1].kwargs.{message}"


def test_config_parsing_rejects_unknown_keys_and_bad_weights():
    with pytest.raises(ConfigError, match=r"rewards\[0\]\.wieght"):
        reward_specs_from_config([{"fn": "exact_match", "wieght": 1}])
    with pytest.raises(ConfigError, match=r"rewards\[1\].weight"):
        reward_specs_from_config(["exact_match", {"fn": "exact_match", "weight": "big"}])
    with pytest.raises(ConfigError, match="rewards: must list at least one"):
        RewardModel([])


def test_an_unknown_reward_key_is_named_by_its_full_path_as_other_unknown_keys_are():
    # it was "strategy.options.rewards[0]: unknown key(s) ['fun']; ...", a Python list
    with pytest.raises(ConfigError) as error:
        reward_specs_from_config([{"fn": "exact_match"}, {"fun": "exact_match", "wieght": 1}], "strategy.options.rewards")
    assert str(error.value) == ("unknown key(s) strategy.options.rewards[1].fun, strategy.options.rewards[1].wieght; "
                                "allowed: fn, kwargs, weight")


@pytest.mark.parametrize("kwargs", ["limit=3", [["limit", 3], "x"], 3])
def test_reward_kwargs_that_are_not_a_mapping_are_a_config_error_naming_them(kwargs):
    # dict() of them raised a bare TypeError / ValueError about "dictionary update sequence"
    with pytest.raises(ConfigError) as e:
        reward_specs_from_config([{"fn": "exact_match"}, {"fn": "format_check", "kwargs": kwargs}],
                                 "strategy.options.rewards")
    assert str(e.value) == f"strategy.options.rewards[1].kwargs: must be a mapping, got {kwargs!r}"


@pytest.mark.parametrize("source, kind", [("async def f(prompt, completion, answer):\n    return 1.0\n", "an async"),
                                          ("def f(prompt, completion, answer):\n    yield 1.0\n", "a generator")])
def test_an_async_or_generator_reward_is_refused_with_the_config(tmp_path, monkeypatch, source, kind):
    # it passed the signature check and failed at the first sample, got <coroutine object f at 0x...>
    module = f"{kind.split()[1]}_rewards_mod"  # one module each: an imported one stays in sys.modules
    user_module(tmp_path, monkeypatch, module, source)
    with pytest.raises(ConfigError) as e:
        RewardModel([RewardSpec("exact_match"), RewardSpec(f"{module}:f")])
    assert str(e.value) == (f"rewards[1].fn: '{module}:f' is {kind} function, whose calls return no "
                            f"number; a reward must be a plain function returning one")


def test_a_callable_instance_with_an_async_call_is_refused_with_the_config(tmp_path, monkeypatch):
    # a class-based reward (an LLM judge holding an async client) passed and failed at the first
    # sample, got <coroutine object Judge.__call__ at 0x...>, after the warm start had trained
    user_module(tmp_path, monkeypatch, "judge_rewards_mod", "class Judge:\n"
                                                            "    async def __call__(self, prompt, completion, answer):\n"
                                                            "        return 1.0\n\njudge = Judge()\n")
    with pytest.raises(ConfigError) as e:
        RewardModel([RewardSpec("judge_rewards_mod:judge")])
    assert str(e.value) == ("rewards[0].fn: 'judge_rewards_mod:judge' is an async function, whose calls return no "
                            "number; a reward must be a plain function returning one")


def test_a_reward_that_changes_its_example_changes_no_other_samples_record(tmp_path, monkeypatch):
    # the group's samples (and every later rollout) shared the task's record: the second sample saw 2 tests
    user_module(tmp_path, monkeypatch, "scratch_rewards_mod", "def f(prompt, completion, answer, example):\n"
                                                              "    example['tests'].append(completion)\n"
                                                              "    return len(example['tests'])\n")
    record = {"tests": ["t1"]}
    total, _ = RewardModel([RewardSpec("scratch_rewards_mod:f")])(["p"] * 3, ["a", "b", "c"], ["", "", ""],
                                                                  examples=[record] * 3)
    assert total.tolist() == [2.0, 2.0, 2.0] and record == {"tests": ["t1"]}


def test_reward_returning_non_number_is_an_error(tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch, "bad_rewards_mod", "def nan(p, c, a):\n    return float('nan')\n")
    model = RewardModel([RewardSpec("bad_rewards_mod:nan")])
    with pytest.raises(ValueError, match="must return a finite number"):
        model(["p"], ["c"], ["a"])


def test_a_reward_computed_with_array_ops_may_return_a_0d_array(tmp_path, monkeypatch):
    # a verifier written with numpy / jax.numpy returns a 0-d array: it was refused as
    # "must return a finite number, got Array(1., dtype=float32)"
    user_module(tmp_path, monkeypatch, "array_rewards_mod", "import numpy as np\nimport jax.numpy as jnp\n"
                                                            "def np0(p, c, a):\n    return np.array(0.5)\n"
                                                            "def jax0(p, c, a):\n    return jnp.mean(jnp.ones(3))\n")
    total, terms = RewardModel([RewardSpec("array_rewards_mod:np0"), RewardSpec("array_rewards_mod:jax0")])(
        ["p"], ["c"], ["a"])
    assert total.tolist() == [1.5] and terms["np0"].tolist() == [0.5] and terms["jax0"].tolist() == [1.0]


def test_a_reward_may_return_a_fraction_a_decimal_or_a_sympy_number(tmp_path, monkeypatch):
    # a partial-credit score kept exact, or a verifier written with sympy: each was refused as
    # "must return a finite number, got 1" (a sympy Integer) or "got Fraction(1, 4)"
    user_module(tmp_path, monkeypatch, "exact_rewards_mod", "from fractions import Fraction\n"
                                                            "from decimal import Decimal\nimport sympy\n"
                                                            "def frac(p, c, a):\n    return Fraction(1, 4)\n"
                                                            "def dec(p, c, a):\n    return Decimal('0.5')\n"
                                                            "def sym(p, c, a):\n    return sympy.Integer(1)\n")
    total, terms = RewardModel([RewardSpec("exact_rewards_mod:frac"), RewardSpec("exact_rewards_mod:dec"),
                                RewardSpec("exact_rewards_mod:sym")])(["p"], ["c"], ["a"])
    assert total.tolist() == [1.75]
    assert (terms["frac"].tolist(), terms["dec"].tolist(), terms["sym"].tolist()) == ([0.25], [0.5], [1.0])


@pytest.mark.parametrize("case, value, requirement", [
    (0, "Decimal('NaN')", "a finite number"),
    (1, "Decimal('-Infinity')", "a finite number"),
    (2, "sympy.nan", "a finite number"),
    (3, "Decimal('1e400')", "a number within float32's range (|v| <= 3.4e+38)"),
    (4, "Fraction(10 ** 400, 3)", "a number within float32's range (|v| <= 3.4e+38)"),
])
def test_a_fraction_decimal_or_sympy_reward_out_of_range_is_an_error(tmp_path, monkeypatch, case, value,
                                                                       requirement):
    module = f"exact_bad_rewards_mod{case}"  # one module a case: an imported module is not read again
    user_module(tmp_path, monkeypatch, module, "from fractions import Fraction\nfrom decimal import Decimal\n"
                                               f"import sympy\ndef f(p, c, a):\n    return {value}\n")
    with pytest.raises(RewardError, match=rf"^reward '{module}:f': must return {re.escape(requirement)}, got "):
        RewardModel([RewardSpec(f"{module}:f")])(["p"], ["c"], ["a"])


def test_a_0d_array_holding_no_number_is_still_an_error(tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch, "array_nan_rewards_mod", "import numpy as np\n"
                                                                "def f(p, c, a):\n    return np.array(np.nan)\n")
    with pytest.raises(RewardError) as e:
        RewardModel([RewardSpec("array_nan_rewards_mod:f")])(["p"], ["c"], ["a"])
    assert str(e.value) == ("reward 'array_nan_rewards_mod:f': must return a finite number, got array(nan) "
                            "(on sample 0, completion 'c')")


def test_a_complex_reward_is_an_error_not_its_real_part(tmp_path, monkeypatch):
    # float() of a numpy complex drops the imaginary part with a warning: it scored 1.0
    user_module(tmp_path, monkeypatch, "complex_rewards_mod", "import numpy as np\n"
                                                              "def f(p, c, a):\n    return np.complex128(1 + 2j)\n")
    model = RewardModel([RewardSpec("complex_rewards_mod:f")])
    with pytest.raises(RewardError) as e:
        model(["p"], ["c"], ["a"])
    assert str(e.value) == ("reward 'complex_rewards_mod:f': must return a finite number, got "
                            "np.complex128(1+2j) (on sample 0, completion 'c')")


def test_reward_beyond_float32_is_an_error_not_an_inf(tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch, "huge_rewards_mod", "def huge(p, c, a):\n    return 1e300\n")
    model = RewardModel([RewardSpec("huge_rewards_mod:huge")])
    with pytest.raises(ValueError, match=r"within float32's range \(\|v\| <= 3.4e\+38\), got 1e\+300"):
        model(["p"], ["c"], ["a"])


def test_an_int_reward_beyond_float64_is_the_float32_range_error(tmp_path, monkeypatch):
    # float() of this int raises OverflowError: it escaped as a traceback naming no reward
    user_module(tmp_path, monkeypatch, "int_rewards_mod", "def huge(p, c, a):\n    return 10 ** 400\n")
    model = RewardModel([RewardSpec("int_rewards_mod:huge")])
    with pytest.raises(RewardError, match=r"reward 'int_rewards_mod:huge': must return a number within float32's "
                                          r"range \(\|v\| <= 3.4e\+38\), got 10{199}\.\.\. \(401 characters\) "
                                          r"\(on sample 0, completion 'c'\)"):
        model(["p"], ["c"], ["a"])


def test_a_reward_returning_a_list_names_the_record_and_completion_in_one_short_line(tmp_path, monkeypatch):
    # a reward written for a batch, returning one score per sample, scored one sample at a time
    user_module(tmp_path, monkeypatch, "list_rewards_mod", "def batch(p, c, a):\n    return [1.0] * 1000\n")
    model = RewardModel([RewardSpec("list_rewards_mod:batch")])
    with pytest.raises(RewardError) as e:
        model(["p"], ["UTKE"], ["UTKE"], wheres=["data/test.jsonl:1"])
    assert str(e.value) == ("reward 'list_rewards_mod:batch': must return a finite number, got "
                            f"{repr([1.0] * 1000)[:200]}... (5,000 characters) (on data/test.jsonl:1, "
                            "completion 'UTKE')")


def test_a_reward_that_calls_sys_exit_names_the_function_and_record(tmp_path, monkeypatch):
    # before: the SystemExit left the trainer with the reward's status and no message
    user_module(tmp_path, monkeypatch, "exit_rewards_mod", "import sys\ndef bye(p, c, a):\n    sys.exit(2)\n")
    model = RewardModel([RewardSpec("exit_rewards_mod:bye")])
    with pytest.raises(RewardError) as e:
        model(["p"], ["c"], ["a"], wheres=["data/train.jsonl:3"])
    assert str(e.value) == "reward 'exit_rewards_mod:bye' raised SystemExit: 2 (on data/train.jsonl:3, completion 'c')"


def test_a_reward_setting_a_sigalrm_timeout_off_the_main_thread_says_why_it_cannot(tmp_path, monkeypatch):
    # off_policy / tools run rewards on worker threads, where Python refuses signal handlers:
    # before, only "signal only works in main thread", not why a reward was off it or what to do
    user_module(tmp_path, monkeypatch, "alarm_rewards_mod",
                "import signal\ndef timed(p, c, a):\n    signal.signal(signal.SIGALRM, signal.SIG_DFL)\n    return 1.0\n")
    model = RewardModel([RewardSpec("alarm_rewards_mod:timed")])
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jrl-rollout") as pool:
        error = pool.submit(model, ["p"], ["c"], ["a"], wheres=["data/train.jsonl:3"]).exception()
    assert isinstance(error, RewardError) and str(error) == (
        "reward 'alarm_rewards_mod:timed' raised ValueError: signal only works in main thread of the main "
        "interpreter (on data/train.jsonl:3, completion 'c'); it ran on the thread 'jrl-rollout_0', as rewards "
        "do with strategy.options.off_policy or tools, where no signal handler can be set (a SIGALRM timeout): "
        "bound it without signals, e.g. in a subprocess with a timeout as math_answer's timeout_s does")


def test_weighted_rewards_that_overflow_float32_are_an_error(tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch, "big_rewards_mod", "def big(p, c, a):\n    return 1e30\n")
    model = RewardModel([RewardSpec("big_rewards_mod:big", 1e20)])
    with pytest.raises(ValueError, match=r"the weighted sum overflows float32 on sample 0 \(terms big=1e\+30\); scale the weights down"):
        model(["p"], ["c"], ["a"])


def test_a_weight_beyond_float32_is_refused_with_the_config():
    # it passed as finite, became inf in float32 and stopped the run at its first reward, after a warm start
    with pytest.raises(ConfigError) as e:
        RewardModel([RewardSpec("exact_match"), RewardSpec("format_check", 1e39, {"pattern": "[0-9]+"})])
    assert str(e.value) == ("rewards[1].weight: must be a number within float32's range (|v| <= 3.4e+38), "
                            "got 1e+39")
