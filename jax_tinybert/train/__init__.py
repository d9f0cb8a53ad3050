"""One stage of training: build (config -> the run's pieces), step (the jitted update), loop
(train_and_evaluate), with its optimizer state, checkpoints, preemption, metrics and workdir lock."""


def __getattr__(name):
    # `from jax_tinybert import train; train.train_and_evaluate(...)`: the loop's names, on first use.
    if name in ("train_and_evaluate", "Preempted"):
        from jax_tinybert.train import loop

        return getattr(loop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
