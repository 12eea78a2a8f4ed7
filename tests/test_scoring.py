"""SQuAD-style EM/F1 as the compared papers compute it: normalised, max over aliases, first line."""

import pytest

from rag_server.bench.scoring import Score, exact_match, first_line, mean_scores, normalize_answer, score_answer, token_f1


def test_normalisation_drops_case_punctuation_articles_and_extra_spaces():
    assert normalize_answer("  The Eiffel-Tower,  in PARIS! ") == "eiffeltower in paris"
    assert normalize_answer("an apple a day") == "apple day"
    # Articles only as whole words.
    assert normalize_answer("Theatre Anthem") == "theatre anthem"


def test_exact_match_after_normalisation():
    assert exact_match("the Spurs.", "Spurs") == 1.0
    assert exact_match("Spurs FC", "Spurs") == 0.0


def test_token_f1_counts_shared_tokens_with_multiplicity():
    # prediction: giotto di bondone (3), gold: giotto (1): p=1/3, r=1, f1=0.5
    assert token_f1("Giotto di Bondone", "Giotto") == pytest.approx(0.5)
    # Repeated tokens count once per occurrence on both sides: common=1, p=1/2, r=1/1.
    assert token_f1("paris paris", "Paris") == pytest.approx(2 / 3)
    assert token_f1("London", "Paris") == 0.0
    assert token_f1("", "") == 1.0
    assert token_f1("the", "Paris") == 0.0  # normalises to nothing


def test_only_the_first_non_empty_line_is_scored():
    assert first_line("\n  Paris, France\nThe Eiffel Tower is in Paris.") == "Paris, France"
    score = score_answer("\nParis\nbecause the documents say so", ["Paris"])
    assert score == Score(em=1.0, f1=1.0)


def test_scores_are_the_max_over_gold_aliases():
    score = score_answer("Tottenham Hotspur", ["Spurs", "Tottenham Hotspur F.C.", "Tottenham"])
    assert score.em == 0.0  # no alias matches exactly
    assert score.f1 == pytest.approx(max(token_f1("Tottenham Hotspur", g) for g in
                                         ["Spurs", "Tottenham Hotspur F.C.", "Tottenham"]))
    assert score.f1 == pytest.approx(0.8)  # vs "tottenham hotspur fc": p=1, r=2/3
    assert score_answer("spurs", ["Spurs", "Tottenham"]).em == 1.0


def test_mean_and_errors():
    assert mean_scores([Score(1.0, 1.0), Score(0.0, 0.5)]) == Score(0.5, 0.75)
    with pytest.raises(ValueError):
        score_answer("x", [])
    with pytest.raises(ValueError):
        mean_scores([])
