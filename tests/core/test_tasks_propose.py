"""The propose-and-solve task (decentrl/tasks/propose.py): proposals are model output, so every
shape a proposer may write is tried; answers and difficulty against direct computations; the
proposer's reward (validity first, then learnability); the config's errors."""

from __future__ import annotations

import itertools
import random

import pytest
from pydantic import ValidationError

from decentrl.config import ConfigError, ProposeTaskConfig, parse_config
from decentrl.model.build import build_tiny_tokenizer
from decentrl.rl.advantages import learnability
from decentrl.tasks import Prompt, build_task
from decentrl.tasks.propose import Proposal, ProposeTask


@pytest.fixture(scope="module")
def task() -> ProposeTask:
    built = build_task(ProposeTaskConfig(min_digits=2, max_digits=8, num_prompts=64, solver_reward="exact"))
    assert isinstance(built, ProposeTask)
    return built


@pytest.mark.parametrize(
    "text",
    [
        "", " ", "7", "123456789", "1" * 10_000, "12=34", "=12", "12a", "-12", "1 2", "1.5", "+12", "١٢٣",
        "１２３", "12\x0034", "12\n34", "0x12", "1e5", "<pad>12", "\u200b12", "12\u0663",
    ],
)
def test_invalid_proposals_are_refused(task: ProposeTask, text: str) -> None:
    assert task.propose(text, 0) is None
    assert task.reward(task.prompt(0), text) == 0.0, "a proposer's ingest reward is its validity"
    assert task.proposer_reward(task.propose(text, 0), [1.0, 0.0]) == -1.0, "validity first: invalid_reward"


@pytest.mark.parametrize("text", ["12", "00", " 90271\n", "12345678"])
def test_valid_proposals(task: ProposeTask, text: str) -> None:
    proposal = task.propose(text, 3)
    assert proposal == Proposal(text.strip()) == task.propose(text, 4), "proposal = problem: the digits as written, on any prompt"
    assert task.reward(task.prompt(3), text) == 1.0


def test_solver_prompt_answer_and_reward(task: ProposeTask) -> None:
    proposal = Proposal("90271")
    prompt = task.solver_prompt(proposal, 5)
    assert prompt == Prompt(prompt_id=5, text="90271=") and task.role_of(prompt) == "solver"
    assert task.role_of(task.prompt(5)) == "proposer" and task.prompt(5).text.startswith("=")
    assert task.answer(proposal) == "01279"
    assert task.reward(prompt, "01279") == 1.0
    assert task.reward(prompt, " 0127 9") == 1.0, "spaces are not the answer"
    assert task.reward(prompt, "0127") == 0.0 and task.reward(prompt, "012799") == 0.0 and task.reward(prompt, "") == 0.0
    with pytest.raises(ValueError, match="not a solver prompt"):
        task.reward(Prompt(prompt_id=0, text="9a="), "9")


def test_positions_reward_is_the_share_right_in_place() -> None:
    task = ProposeTask(ProposeTaskConfig(solver_reward="positions"))
    prompt = task.solver_prompt(Proposal("90271"), 0)  # answer 01279
    assert task.reward(prompt, "01279") == 1.0
    assert task.reward(prompt, "01299") == 0.8
    assert task.reward(prompt, "0127") == 0.8 and task.reward(prompt, "0127999999") == 0.5, "padding never pays"
    assert task.reward(prompt, "") == 0.0


def test_sum_operation() -> None:
    task = ProposeTask(ProposeTaskConfig(operation="sum", solver_reward="exact"))
    proposal = Proposal("9999")
    assert task.answer(proposal) == "36"
    assert task.reward(task.solver_prompt(proposal, 0), "36") == 1.0
    assert task.difficulty(proposal).operations == 3 and task.difficulty(proposal).digits == 4


def test_difficulty_counts_the_adjacent_swaps_that_sort() -> None:
    task = ProposeTask(ProposeTaskConfig())
    for digits in ["12", "21", "321", "90271", "5555", "9876543210"]:
        # Bubble sort counts adjacent swaps: the definition of the sort's operations.
        chars, swaps = list(digits), 0
        for _ in range(len(chars)):
            for i in range(len(chars) - 1):
                if chars[i] > chars[i + 1]:
                    chars[i], chars[i + 1] = chars[i + 1], chars[i]
                    swaps += 1
        assert task.difficulty(Proposal(digits)).operations == swaps
        assert task.difficulty(Proposal(digits)).digits == len(digits)


def test_proposer_reward_is_learnability_after_validity() -> None:
    for rule in ("absolute_zero", "r_zero"):
        task = ProposeTask(ProposeTaskConfig(learnability=rule, invalid_reward=-0.5))
        for solves in itertools.product([0.0, 1.0], repeat=3):
            assert task.proposer_reward(Proposal("12"), list(solves)) == learnability(list(solves), rule)
        assert task.proposer_reward(None, [1.0]) == -0.5


def test_prompts_are_seeded_and_tokenize_in_the_tiny_vocabulary() -> None:
    a, b = ProposeTask(ProposeTaskConfig(seed=3)), ProposeTask(ProposeTaskConfig(seed=3))
    assert [a.prompt(i) for i in range(20)] == [b.prompt(i) for i in range(20)]
    assert a.prompt(0) != ProposeTask(ProposeTaskConfig(seed=4)).prompt(0) or a.prompt(1) != ProposeTask(
        ProposeTaskConfig(seed=4)).prompt(1)
    tokenizer = build_tiny_tokenizer()
    unk = tokenizer.convert_tokens_to_ids("<pad>")
    for text in [a.prompt(0).text, a.solver_prompt(Proposal("90271"), 0).text]:
        assert unk not in tokenizer(text)["input_ids"], f"{text!r} uses a symbol the tiny model lacks"


def test_config_errors_say_what_to_fix() -> None:
    roles = {"orchestrator": {"roles": {}, "advantages": {"type": "roles"}}}
    with pytest.raises(ConfigError, match="lower min_digits"):
        parse_config({"task": {"type": "propose", "min_digits": 9, "max_digits": 3}, **roles})
    with pytest.raises(ConfigError, match="invalid_reward"):
        parse_config({"task": {"type": "propose", "invalid_reward": 0.5}, **roles})
    with pytest.raises(ConfigError, match="learnability"):
        parse_config({"task": {"type": "propose", "learnability": "spiral"}, **roles})
    with pytest.raises(ConfigError, match="set all three or none"):
        parse_config({"task": {"type": "propose"}})
    assert isinstance(parse_config({"task": {"type": "propose"}, **roles}).task, ProposeTaskConfig)


def test_the_kept_solver_reward_pays_the_one_digit_answer_a_little() -> None:
    task = ProposeTask(ProposeTaskConfig(solver_reward="kept"))
    prompt = task.solver_prompt(Proposal("90271"), 0)
    assert task.reward(prompt, "01279") == 1.0 and task.reward(prompt, "90271") == 0.4, "sorted 1; a copy keeps its place credit"
    assert task.reward(prompt, "77777") == pytest.approx(0.2 * 0.2), "one 7 in place, one of the five digits kept"
    assert task.reward(prompt, "0127") == pytest.approx(0.8 * 0.8), "a digit dropped: still something to climb"
    with pytest.raises(ValidationError, match="solver_reward = 'kept' needs task.operation = 'sort'"):
        ProposeTaskConfig(solver_reward="kept", operation="sum")


def test_the_permutation_solver_reward_pays_no_one_digit_answer() -> None:
    task = ProposeTask(ProposeTaskConfig(solver_reward="permutation"))
    prompt = task.solver_prompt(Proposal("90271"), 0)
    assert task.reward(prompt, "01279") == 1.0 and task.reward(prompt, " 0127 9") == 1.0, "sorted: 1"
    assert task.reward(prompt, "90271") == 0.4, "copied: a permutation, its digits right in place (2 and 7 of 01279)"
    assert task.reward(prompt, "01297") == 0.6
    for answer in ("77777", "00000", "0127", "012799", "01278", "", "0127x"):
        assert task.reward(prompt, answer) == 0.0, f"not a permutation of the problem's digits: {answer!r}"
    assert ProposeTask(ProposeTaskConfig(solver_reward="positions")).reward(prompt, "77777") == 0.2, "what positions paid it"
    partial = ProposeTask(ProposeTaskConfig(solver_reward="permutation", pass_rate="reward"))
    assert partial.passed(prompt, "01297") == 0.6 and partial.passed(prompt, "77777") == 0.0, "the proposer's p reads the same reward"
    with pytest.raises(ValidationError, match="solver_reward = 'permutation' needs task.operation = 'sort'"):
        ProposeTaskConfig(solver_reward="permutation", operation="sum")
    with pytest.raises(ValidationError, match="solver_reward"):
        ProposeTaskConfig(solver_reward="permutations")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="solver_reward"):
        parse_config({"task": {"type": "propose", "solver_reward": "permutation", "operation": "sum"},
                      "orchestrator": {"roles": {}, "advantages": {"type": "roles"}}})


def test_the_proposers_p_is_the_exact_pass_rate_unless_told_otherwise() -> None:
    task = ProposeTask(ProposeTaskConfig(solver_reward="positions", pass_rate="exact"))
    prompt = task.solver_prompt(Proposal("9027"), 0)
    assert task.reward(prompt, "0297") == 0.5, "the solver's partial credit"
    assert task.passed(prompt, "0297") == 0.0 and task.passed(prompt, " 0279\n") == 1.0, "the pass the proposer reads"
    partial = ProposeTask(ProposeTaskConfig(solver_reward="positions"))  # the default: the solvers' rewards
    assert partial.passed(prompt, "0297") == 0.5
    with pytest.raises(ValidationError, match="pass_rate"):
        ProposeTaskConfig(pass_rate="mean")  # type: ignore[arg-type]


def test_a_size_proposal_names_the_size_and_the_task_draws_the_digits() -> None:
    # proposal = "size": the proposer's digits name only how many; the problem is drawn, seeded by the unit's prompt and the text.
    task = ProposeTask(ProposeTaskConfig(proposal="size", min_digits=2, max_digits=8, solver_reward="exact", seed=4))
    sorted_text = task.propose("0123456", 7)
    assert sorted_text is not None and len(sorted_text.digits) == 7 and sorted_text.digits.isdigit()
    assert sorted_text == task.propose(" 0123456\n", 7), "reproducible: the same prompt and text, the same problem"
    assert sorted_text.canonical == "0123456", "the repetition penalty and distinct count see what the proposer wrote"
    drawn = [task.propose(f"{n:05d}", 7) for n in range(200)]
    assert all(p is not None and len(p.digits) == 5 for p in drawn)
    assert len({p.digits for p in drawn if p}) == 200, "other text of one size: another problem"
    assert sum(p.digits == "".join(sorted(p.digits)) for p in drawn if p) < 10, "writing digits in order does not make the problem easy"
    assert ProposeTask(ProposeTaskConfig(proposal="size", seed=5)).propose("0123456", 7) != sorted_text, "the task's seed draws too"
    for text in ("1", "123456789", "12a", ""):
        assert task.propose(text, 7) is None and task.proposer_reward(None, []) == -1.0
    # The solvers answer the drawn problem (its prompt, not the proposal's text) exactly.
    prompt = task.solver_prompt(sorted_text, 9)
    assert prompt.text == sorted_text.digits + "="
    assert task.reward(prompt, "".join(sorted(sorted_text.digits))) == 1.0
    assert task.reward(prompt, sorted_text.digits) == float(sorted_text.digits == "".join(sorted(sorted_text.digits)))
    assert task.difficulty(sorted_text).digits == 7
    with pytest.raises(ValidationError, match="proposal"):
        ProposeTaskConfig(proposal="digits")


def test_a_repeated_size_proposal_is_another_problem_on_each_unit() -> None:
    # A proposer collapsed onto one text ("2222") once got one problem every time, and its solvers
    # memorised the answer: the digits are drawn per unit (its prompt), so one text is many problems.
    task = ProposeTask(ProposeTaskConfig(proposal="size", min_digits=2, max_digits=8, seed=0))
    repeated = [task.propose("2222", prompt_id) for prompt_id in range(200)]
    assert all(p is not None and len(p.digits) == 4 and p.canonical == "2222" for p in repeated)
    assert len({p.digits for p in repeated if p}) >= 190, "one text on 200 units: (nearly) 200 problems of 4 digits"
    assert len({"".join(sorted(p.digits)) for p in repeated if p}) >= 150, "and no one answer to memorise"


def test_a_tally_proposal_is_min_digits_plus_its_nines() -> None:
    # proposal = "tally": the size is min_digits plus the 9s written, so digits at random (an
    # untrained proposer) make short problems, and a proposer writes more 9s for longer ones.
    task = ProposeTask(ProposeTaskConfig(proposal="tally", min_digits=2, max_digits=12, solver_reward="exact", seed=4))
    for text, size in (("0", 2), ("123", 2), ("9", 3), ("19293", 4), (" 9999999999\n", 12), ("0" * 40 + "9", 3),
                       ("99999999999", 12), ("9" * 1024, 12)):  # more 9s than max_digits allows: the largest, not invalid
        proposal = task.propose(text, 7)
        assert proposal is not None and len(proposal.digits) == size and proposal.digits.isdigit(), text
        assert proposal.canonical == text.strip() and task.difficulty(proposal).digits == size
    assert task.propose("19293", 7) == task.propose("19293", 7) != task.propose("19293", 8), "drawn per unit, as size"
    drawn = [task.propose(f"99{n:o}", 7) for n in range(200)]  # octal: no other 9s, every one 4 digits (10,000 problems)
    assert all(p is not None and len(p.digits) == 4 for p in drawn)
    assert len({p.digits for p in drawn if p}) >= 190, "other text of one size: (nearly always) another problem"
    # Invalid: no digits, a non-digit, or past the longest text read (checked first).
    for text in ("", " ", "9a", "=9", "1 9", "١٩", "1" * 1025, "9" * 10_000):
        assert task.propose(text, 7) is None, text
    assert task.propose("1" * 1024, 7) is not None
    # Random digits, as an untrained proposer writes them, make short problems (about a tenth of them 9s).
    rng = random.Random(0)
    sizes = [len(p.digits) for p in (task.propose("".join(rng.choice("0123456789") for _ in range(10)), i) for i in range(500)) if p]
    assert 2.5 < sum(sizes) / len(sizes) < 3.5
