"""A reward for the evaluation tests: the "answer" of a response is its first character's code mod 3
(or "empty"), so the answers of a random tiny model fall into few classes and majority votes mean something."""


def first_char_class(response: str, ground_truth: str, **_) -> dict:
    pred = str(ord(response[0]) % 3) if response else "empty"
    acc = pred == ground_truth
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}
