"""A settable clock for the coordinator's policies, which take any `() -> seconds` callable."""


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t
