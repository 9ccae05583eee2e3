"""A stop string of several tokens ends the completion after the token that completes it."""

from __future__ import annotations

from rollout_workers.engine import Completion, cut_at_stop_strings

VOCAB = {i: ch for i, ch in enumerate("ab\n#xyz")}


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def completion(text: str, segments=()) -> Completion:
    ids = [next(k for k, v in VOCAB.items() if v == ch) for ch in text]
    return Completion(ids, [-0.1 * (i + 1) for i in range(len(ids))], "length", 3, segments)


def test_the_completion_ends_with_the_first_stop_string():
    c = cut_at_stop_strings(completion("ab\n\nxy\n\nz"), ("\n\n",), decode)
    assert decode(c.token_ids) == "ab\n\n" and c.finish_reason == "stop"
    assert c.logprobs == completion("ab\n\nxy\n\nz").logprobs[:4]


def test_the_earliest_of_several_stop_strings_wins():
    c = cut_at_stop_strings(completion("xxab#yz##"), ("##", "#y"), decode)
    assert decode(c.token_ids) == "xxab#y"


def test_no_stop_string_leaves_it_as_it_is():
    c = completion("abxyz")
    assert cut_at_stop_strings(c, ("##",), decode) is c
    assert cut_at_stop_strings(c, (), decode) is c


def test_version_segments_are_cut_with_it():
    c = cut_at_stop_strings(completion("ab##xyz", segments=((0, 3, 3), (3, 7, 4))), ("##",), decode)
    assert c.version_segments() == ((0, 3, 3), (3, 4, 4))


def test_one_token_stop_strings_are_stop_ids_and_longer_ones_are_cut_in_the_text():
    from rollout_workers.engine import stop_rules

    encode = lambda s: [next(k for k, v in VOCAB.items() if v == ch) for ch in s]  # noqa: E731
    assert stop_rules(["#", "\n\n", "x"], encode) == (frozenset({3, 4}), ("\n\n",))
    assert stop_rules([], encode) == (frozenset(), ())
