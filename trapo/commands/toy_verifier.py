"""The toy `reverse` task's verifier (docs/tasks.md), written as a user would write one in their own module;
it ships in the package so configs/toy_reverse.yaml runs wherever trapo is installed.

The toy model answers "reverse FCAB =" with `answer: BACF`. Math-Verify cannot grade that (letters are
not numbers), so the run names this object instead:

    reward.verifier: trapo.commands.toy_verifier:ReverseVerifier      (configs/toy_reverse.yaml)

Any module on PYTHONPATH works the same way (tests/training/test_task_verifier_runs.py plugs in one written
in a folder outside the repository).
"""

import re

_ANSWER = re.compile(r"answer:\s*([A-Za-z]+)")


class ReverseVerifier:
    def extract(self, response: str) -> str | None:
        """The last `answer: WORD` in the response; None when there is none."""
        found = _ANSWER.findall(response)
        return found[-1] if found else None

    def equal(self, answer: str, gold: str) -> bool:
        return self.key(answer) == self.key(gold)

    def key(self, answer: str) -> str:
        """Case does not matter: `bacf` and `BACF` are one answer, counted together in the vote."""
        return answer.strip().upper()
