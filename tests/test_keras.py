"""Keras 3 on the torch backend: its optimizer is refused in words that say what it is and what
gh.GradHealth(model) then cannot see; integer state (the seed generator's) and a layer's declared
non-trainable state (BatchNorm's moving statistics) are never frozen trouble, while a layer frozen
on purpose is still judged by expect_frozen."""

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")  # (before keras is imported)
keras = pytest.importorskip("keras")
if keras.backend.backend() != "torch":
    pytest.skip("keras was imported with another backend in this process", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import gradhealth as gh  # noqa: E402
from conftest import naive_classify  # noqa: E402

torch.set_num_threads(1)


def _model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, name="body"), keras.layers.Dense(16, name="frozen"),
                              keras.layers.BatchNormalization(name="bn"), keras.layers.Dropout(0.1, name="drop"),
                              keras.layers.Dense(1, name="head")], name="net")
    model.get_layer("frozen").trainable = False  # frozen on purpose
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


class Check(keras.callbacks.Callback):
    def __init__(self, **options):
        super().__init__()
        self.options, self.reports, self.naive = options, [], []

    def on_train_begin(self, logs=None):
        self.monitor = gh.GradHealth(self.model, **self.options)

    def on_train_batch_end(self, batch, logs=None):  # (Keras's step leaves the gradients in .grad until the next)
        self.naive.append(list(naive_classify(self.model).values()))
        self.reports.append(self.monitor.check())

    def on_train_end(self, logs=None):
        self.monitor.close()


def _data():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((128, 4)).astype("float32")
    return X, (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32"))


def test_keras_optimizer_is_refused_saying_what_it_is_and_what_is_lost():
    model = _model()
    with pytest.raises(TypeError) as info:
        gh.GradHealth(model, model.optimizer)
    words = str(info.value)
    assert "keras's optimizer" in words and "Adam" in words and "gh.GradHealth(model)" in words
    assert "NOT_IN_OPTIMIZER" in words and "NOT_UPDATED" in words and "learning rate of 0" in words


def test_keras_fit_with_a_layer_frozen_on_purpose_is_silent():
    model, X, Y = _model(), *_data()
    check = Check(on_problem="raise", expect_frozen=["net/frozen/*"])
    history = model.fit(X, Y, epochs=6, batch_size=16, verbose=0, callbacks=[check])
    assert history.history["loss"][-1] < history.history["loss"][0]  # healthy: it trains
    r = check.reports[-1]
    # the premise: integer seed state and BatchNorm's moving statistics are Parameters, frozen
    params = {n: p for n, p in model.named_parameters()}
    seed = next(p for n, p in params.items() if "seed_generator_state" in n)
    assert not seed.is_floating_point() and not seed.requires_grad
    assert r.status["net/bn/moving_mean"] is gh.Status.FROZEN
    assert [s for n, s in r.status.items() if "seed_generator_state" in n] == [gh.Status.FROZEN]
    assert all(list(r.status.values()) == n for r, n in zip(check.reports, check.naive))  # the naive loop agrees
    assert all(r.ok and not r.findings_of("UNEXPECTED_FROZEN") for r in check.reports)


def test_a_keras_layer_frozen_by_mistake_is_named_alone():
    model, X, Y = _model(), *_data()
    check = Check(on_problem="ignore", expect_frozen=["nothing/*"])
    model.fit(X[:32], Y[:32], epochs=1, batch_size=16, verbose=0, callbacks=[check])
    [f] = check.reports[-1].findings_of("UNEXPECTED_FROZEN")
    assert set(f.params) == {"net/frozen/kernel", "net/frozen/bias"}  # not the state
