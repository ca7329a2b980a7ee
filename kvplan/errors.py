"""kvplan's error classes. The pool's and the checked mode's are ``RuntimeError`` so engines that catch runtime
failures around a step still see them; :class:`NotAnIntError` is the one rule for a non-int where an int belongs."""


class PoolCapacityError(RuntimeError):
    """A view or launch asked for a shape the pool was not sized for; call ``ensure_capacity`` (or ``reserve``)."""


class PoolBudgetError(RuntimeError):
    """Growth would pass ``PoolConfig.max_bytes``, or the allocation failed; the pool is unchanged."""


class PoolFrozenError(RuntimeError):
    """Growth was needed while the pool is frozen or the current stream is capturing a CUDA graph."""


class CheckMismatchError(RuntimeError):
    """The checked mode (``PoolConfig(check=True)``) found a launch whose result differs from the reference's."""


class TokensDroppedError(RuntimeError):
    """The checked mode saw a speculative swap-in drop tokens (output ``-1``) for want of hot slots and scratch rows;
    ``kvplan.sizing.scratch_rows`` gives the rows that drop none.

    The step ran (it is raised after the launch was checked): outputs, the state's tables, device rows and counters
    are written, exactly as the reference writes them. ``plan`` is the :class:`~kvplan.MissPlan` the swap-in
    returned (replay it, or redo the step with enough scratch rows); ``dropped`` the tokens dropped."""

    def __init__(self, message: str, *, plan: object = None, dropped: int = 0) -> None:
        super().__init__(message)
        self.plan = plan
        self.dropped = dropped

    def __reduce__(self):  # keyword-only fields survive pickling (multiprocessing workers re-raise it)
        return (_tokens_dropped, (self.args[0], self.plan, self.dropped))


def _tokens_dropped(message: str, plan: object, dropped: int) -> TokensDroppedError:
    return TokensDroppedError(message, plan=plan, dropped=dropped)


class StateCheckError(RuntimeError):
    """``HotBufferState.check`` (run by the checked mode before every swap-in) found tables that break a rule the docs
    state for the step: a short request's token ``t`` not at hot slot ``t``, a tail not holding the newest tokens,
    too few scratch rows, an LRU row that is not a permutation or a token in two hot slots. Nothing was launched."""


class NotAnIntError(TypeError, ValueError):
    """A bool, float, tensor or other non-int where an int belongs: a ``TypeError``, the rule for every wrong type.
    Also a ``ValueError``, which some of these checks raised before, so callers catching that still catch it."""
