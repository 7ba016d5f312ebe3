"""SkipCorrectionOptimizer in a custom training loop (strategy.run + GradientTape)."""

import internals
import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import components, max_replica_spread, mirrored
from test_against_reference import (
    EPOCHS,
    GLOBAL_BATCH,
    REPLICAS,
    STEPS_PER_EPOCH,
    D,
    assert_relative,
    corrections_of,
    make_data,
    reference,
    start_weights,
    weights_of,
)
from test_against_reference import linear_model as reference_model

import keras_skip
from keras_skip import maths


def linear_model(strategy, make_inner, **skip):
    with strategy.scope():
        model = reference_model()
        optimizer = keras_skip.SkipCorrectionOptimizer(make_inner(), **skip)
        optimizer.build(model.trainable_variables)
    optimizer.attach(model)
    return model, optimizer


def make_step(strategy, model, optimizer, loss_style):
    keras_loss = keras.losses.MeanSquaredError()

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            prediction = model(x, training=True)
            if loss_style == "compute_average_loss":
                per_example = tf.reduce_mean(tf.square(prediction - y), axis=-1)
                loss = tf.nn.compute_average_loss(
                    per_example, global_batch_size=GLOBAL_BATCH
                )
            else:  # a Keras loss scales by 1 / replicas itself in replica context
                loss = keras_loss(y, prediction)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def step(batch):
        return strategy.run(replica_step, args=batch)

    return step


def dataset(strategy, repeat=False):
    x, y = make_data()
    xs = x.reshape(-1, D).astype("float32")
    ys = y.reshape(-1, 1).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(GLOBAL_BATCH)
    if repeat:
        data = data.repeat()
    return strategy.experimental_distribute_dataset(data)


def train(
    strategy,
    model,
    optimizer,
    loss_style="compute_average_loss",
    epochs=EPOCHS,
    boundary="eager",
):
    step = make_step(strategy, model, optimizer, loss_style)

    @tf.function
    def average_in_graph():
        return optimizer.average()

    for _ in range(epochs):
        for batch in dataset(strategy):
            step(batch)
        if boundary == "eager":
            optimizer.average()
        else:
            with strategy.scope():
                average_in_graph()


@pytest.mark.parametrize("loss_style", ["compute_average_loss", "keras_loss"])
def test_custom_loop_matches_the_reference(loss_style):
    strategy = mirrored(REPLICAS)
    model, optimizer = linear_model(
        strategy, lambda: keras.optimizers.SGD(0.05, momentum=0.9), interval=3
    )
    train(strategy, model, optimizer, loss_style)
    expected = reference(maths.sgd(0.9), interval=3, correction=1.0)
    assert_relative(weights_of(model), expected.x)
    assert_relative(corrections_of(optimizer), expected.correction)
    assert optimizer.averages_performed == expected.averages


@pytest.mark.parametrize("boundary", ["eager", "graph"])
def test_streaming_averages_in_a_custom_loop_match_the_reference(boundary):
    """fragments=2 (the kernel, then the bias): each fragment averaged on
    its own schedule in the step, the boundary average (eager or inside a
    `tf.function`) covering both; `overlap=3` has no host to delay it, so
    its averages run after their step."""
    strategy = mirrored(REPLICAS)
    model, optimizer = linear_model(
        strategy,
        lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        interval=4,
        fragments=2,
        overlap=3,
    )
    train(strategy, model, optimizer, boundary=boundary)
    parts = internals.fragments(optimizer)
    assert [p.tolist() for p in parts] == [list(range(D)), [D]]
    expected = reference(maths.sgd(0.9), interval=4, correction=1.0, fragments=parts)
    assert_relative(weights_of(model), expected.x)
    assert_relative(corrections_of(optimizer), expected.correction)
    assert optimizer.averages_performed == expected.averages
    assert max_replica_spread(model.trainable_variables) == 0.0


def test_interval_1_in_a_custom_loop_is_synchronous_adam():
    strategy = mirrored(REPLICAS)
    model, optimizer = linear_model(
        strategy, lambda: keras.optimizers.Adam(0.01), interval=1
    )
    train(strategy, model, optimizer)
    expected = maths.synchronous(
        reference_start(),
        reference_grads(),
        n=REPLICAS,
        steps=STEPS_PER_EPOCH * EPOCHS,
        learning_rate=0.01,
        inner=maths.adam(),
    )
    assert_relative(weights_of(model)[0], expected)


def reference_start():
    kernel, bias = start_weights()
    return np.concatenate([kernel[:, 0], bias])


def reference_grads():
    from test_against_reference import grad_fn

    return grad_fn(*make_data())


def test_boundary_average_from_inside_a_tf_function():
    strategy = mirrored(REPLICAS)
    model, optimizer = linear_model(
        strategy, lambda: keras.optimizers.SGD(0.05), interval=100
    )
    step = make_step(strategy, model, optimizer, "compute_average_loss")
    for batch in dataset(strategy):
        step(batch)
    assert max_replica_spread(model.trainable_variables) > 0
    assert optimizer.local_steps_since_average == STEPS_PER_EPOCH

    @tf.function
    def average_in_replica_context():
        return strategy.run(lambda: optimizer.average())

    average_in_replica_context()
    assert max_replica_spread(model.trainable_variables) == 0
    assert optimizer.local_steps_since_average == 0
    assert optimizer.averages_performed == 1
    assert optimizer.average() is False  # nothing pending: no communication


def test_the_graph_boundary_average_matches_the_eager_one():
    results = []
    for boundary in ("eager", "graph"):
        strategy = mirrored(REPLICAS)
        model, optimizer = linear_model(
            strategy, lambda: keras.optimizers.SGD(0.05), interval=4
        )
        train(strategy, model, optimizer, boundary=boundary)
        results.append(weights_of(model))
    np.testing.assert_array_equal(results[0], results[1])


def test_multi_replica_custom_loop_without_attach_is_a_clear_error():
    strategy = mirrored(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((D,)), keras.layers.Dense(1)])
        optimizer = keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(0.05))
    step = make_step(strategy, model, optimizer, "keras_loss")
    batch = next(iter(dataset(strategy)))
    with pytest.raises(RuntimeError, match=r"optimizer\.attach\(model\)"):
        step(batch)


def checkpointed_run(tmp_path, split):
    """Adam with local slots on 4 replicas; checkpoint after `split` epochs,
    restore into fresh objects, continue. split=None: uninterrupted."""
    strategy = mirrored(REPLICAS)
    make_inner = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    model, optimizer = linear_model(strategy, make_inner, interval=3)
    if split is None:
        train(strategy, model, optimizer, epochs=2)
        return model, optimizer
    train(strategy, model, optimizer, epochs=split)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = tf.train.CheckpointManager(checkpoint, str(tmp_path), max_to_keep=2)
    manager.save()
    strategy = mirrored(REPLICAS)
    restored_model, restored_optimizer = linear_model(strategy, make_inner, interval=9)
    status = tf.train.Checkpoint(
        model=restored_model, optimizer=restored_optimizer
    ).restore(manager.latest_checkpoint)
    status.assert_existing_objects_matched()
    assert restored_optimizer.interval == 3
    for a, b in zip(optimizer.variables, restored_optimizer.variables, strict=True):
        for ca, cb in zip(components(a), components(b), strict=True):
            np.testing.assert_array_equal(cb, ca)
    train(strategy, restored_model, restored_optimizer, epochs=2 - split)
    return restored_model, restored_optimizer


def test_tf_train_checkpoint_restores_every_replica_and_training_continues_exactly(
    tmp_path,
):
    uninterrupted, optimizer_a = checkpointed_run(tmp_path / "a", None)
    resumed, optimizer_b = checkpointed_run(tmp_path / "b", 1)
    np.testing.assert_allclose(
        weights_of(resumed), weights_of(uninterrupted), rtol=1e-6
    )
    assert (
        max_replica_spread(internals.slot_variables(optimizer_b)) > 0
    )  # slots differ per replica
    for a, b in zip(
        internals.slot_variables(optimizer_a),
        internals.slot_variables(optimizer_b),
        strict=True,
    ):
        for ca, cb in zip(components(a), components(b), strict=True):
            np.testing.assert_allclose(cb, ca, rtol=1e-6, atol=1e-9)
    assert optimizer_b.averages_performed == optimizer_a.averages_performed


def test_checkpoint_restored_on_another_replica_count_warns(tmp_path):
    strategy = mirrored(REPLICAS)
    model, optimizer = linear_model(
        strategy, lambda: keras.optimizers.SGD(0.05, momentum=0.9), interval=3
    )
    train(strategy, model, optimizer, epochs=1)
    path = tf.train.Checkpoint(optimizer=optimizer).save(str(tmp_path / "ckpt"))
    _other_model, other = linear_model(
        mirrored(2), lambda: keras.optimizers.SGD(0.05, momentum=0.9), interval=3
    )
    with pytest.warns(UserWarning, match="corrections restart from zero"):
        tf.train.Checkpoint(optimizer=other).restore(path)
    for c in internals.corrections(other):
        assert all(not np.any(copy) for copy in components(c))
    momentum = internals.slot_variables(other)[0]
    expected = np.mean(components(internals.slot_variables(optimizer)[0]), axis=0)
    np.testing.assert_allclose(components(momentum)[0], expected, rtol=1e-6)


def test_choose_interval_in_a_custom_loop_and_keep_it_after_a_restore(tmp_path):
    strategy = mirrored(2)
    model, optimizer = linear_model(
        strategy, lambda: keras.optimizers.SGD(0.05), interval=7
    )
    step = make_step(strategy, model, optimizer, "compute_average_loss")
    batches = iter(dataset(strategy, repeat=True))
    optimizer.interval = 1
    step(next(batches))  # traces the step function
    calls = []

    def run_local_steps():
        before = (optimizer.synchronous_steps, optimizer.averages_performed)
        step(next(batches))
        after = (optimizer.synchronous_steps, optimizer.averages_performed)
        calls.append((after[0] - before[0], after[1] - before[1]))

    decision = keras_skip.choose_interval(optimizer, run_local_steps, steps=1)
    # Three rounds of two local steps (one step would be synchronous): the
    # first and the last end with an average.
    assert calls == [(0, 0), (0, 1), (0, 0), (0, 0), (0, 0), (0, 1)]

    assert optimizer.interval == decision.interval
    assert optimizer.interval_decision == decision
    assert decision.interval == maths.adaptive_interval(
        decision.t_comm, decision.t_comp
    )
    assert optimizer.local_steps_since_average == 0
    path = tf.train.Checkpoint(optimizer=optimizer).save(str(tmp_path / "ckpt"))
    _, restored = linear_model(
        mirrored(2), lambda: keras.optimizers.SGD(0.05), interval=7
    )
    tf.train.Checkpoint(optimizer=restored).restore(path)
    again = keras_skip.choose_interval(restored, lambda: pytest.fail("probed again"))
    assert again == decision
    assert restored.interval == decision.interval


@pytest.mark.parametrize("overlap", [True, 3], ids=["one-step", "delayed"])
def test_choose_interval_counts_only_the_step_an_overlapped_average_hides(overlap):
    """Averages of 0.3 s and steps of about 30 ms (the loop sleeps; the probe
    times the host). `overlap=True` hides all of one step's time (share 1):
    the interval is exactly one step shorter than without overlap. A delayed
    average runs after its execution in a custom loop and hides nothing."""
    import time

    strategy = mirrored(2)
    model, optimizer = linear_model(
        strategy, lambda: keras.optimizers.SGD(0.05), interval=7, overlap=overlap
    )
    internals.delay_averages(optimizer, 0.3)
    step = make_step(strategy, model, optimizer, "compute_average_loss")
    batches = iter(dataset(strategy, repeat=True))
    optimizer.interval = 1
    step(next(batches))

    def run_local_steps():
        time.sleep(0.03)
        step(next(batches))

    decision = keras_skip.choose_interval(
        optimizer, run_local_steps, steps=1, overlap_share=1.0
    )
    blocking = maths.adaptive_interval(decision.t_comm, decision.t_comp)
    assert blocking > 2
    assert decision.interval == (blocking - 1 if overlap is True else blocking)


def test_choose_interval_needs_a_built_optimizer():
    optimizer = keras_skip.SkipCorrectionOptimizer(keras.optimizers.SGD(0.05))
    with pytest.raises(ValueError, match="run one training step first"):
        keras_skip.choose_interval(optimizer, lambda: None)


@pytest.mark.slow
def test_custom_loop_on_two_workers_ends_with_identical_weights(tmp_path):
    import sys

    from workers import custom_loop_worker

    from keras_skip.bench.workers import launcher

    result = launcher.launch(
        [sys.executable, custom_loop_worker.__file__, str(tmp_path)],
        2,
        timeout=240,
        log_dir=tmp_path / "logs",
    )
    assert result.ok, result.failure_report()
    outputs = [np.load(tmp_path / f"worker-{i}.npz") for i in range(2)]
    np.testing.assert_array_equal(outputs[0]["weights"], outputs[1]["weights"])
    assert np.abs(outputs[0]["first_local"] - outputs[1]["first_local"]).max() > 1e-6
    # 256 / 16 = 16 steps per epoch, interval 3: 5 interval averages and a
    # boundary average per epoch.
    assert int(outputs[0]["averages"]) == 12


def traced_synchronous_loop():
    """A 2-replica custom loop at interval 1 whose step function has run
    once (traced): (model, optimizer, step, batches)."""
    strategy = mirrored(2)
    model, optimizer = linear_model(strategy, lambda: keras.optimizers.SGD(0.05))
    step = make_step(strategy, model, optimizer, "compute_average_loss")
    batches = iter(dataset(strategy))
    optimizer.interval = 1
    step(next(batches))
    return model, optimizer, step, batches


def test_choose_interval_rejects_a_round_shorter_than_steps():
    _, optimizer, step, batches = traced_synchronous_loop()
    with pytest.raises(
        ValueError, match=r"must run exactly steps=3 training steps.*ran fewer"
    ):
        keras_skip.choose_interval(optimizer, lambda: step(next(batches)), steps=3)
    # Nothing is left probing: the next steps are synchronous again.
    synchronous = optimizer.synchronous_steps
    step(next(batches))
    assert optimizer.synchronous_steps == synchronous + 1


def test_choose_interval_rejects_a_round_longer_than_steps():
    model, optimizer, step, batches = traced_synchronous_loop()

    def three_steps():
        for _ in range(3):
            step(next(batches))

    with pytest.raises(
        ValueError, match=r"must run exactly steps=2 training steps.*ran more"
    ):
        keras_skip.choose_interval(optimizer, three_steps, steps=2)
    assert optimizer.interval_decision is None
    assert optimizer.interval == 1
    # Nothing is left probing: the next step averages the extra local step
    # away and is synchronous again.
    synchronous, averages = optimizer.synchronous_steps, optimizer.averages_performed
    step(next(batches))
    assert optimizer.synchronous_steps == synchronous + 1
    assert optimizer.averages_performed == averages + 1
    assert max_replica_spread(model.trainable_variables) == 0.0


def test_choose_interval_waits_for_the_warmup():
    strategy = mirrored(2)
    model, optimizer = linear_model(
        strategy, lambda: keras.optimizers.SGD(0.05), warmup_steps=5
    )
    step = make_step(strategy, model, optimizer, "compute_average_loss")
    step(next(iter(dataset(strategy))))
    with pytest.raises(ValueError, match=r"taken 1 of its warmup_steps=5"):
        keras_skip.choose_interval(optimizer, lambda: None)


def test_choose_interval_gives_the_interval_back_when_a_round_raises():
    _, optimizer, step, batches = traced_synchronous_loop()
    calls = []

    def failing_second_round():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the user stops the loop mid-probe
        step(next(batches))

    with pytest.raises(KeyboardInterrupt):
        keras_skip.choose_interval(optimizer, failing_second_round, steps=1)
    assert optimizer.interval_decision is None
    assert optimizer.interval == 1
    assert optimizer.steering.interval_now() == 1  # no probe interval left behind
    assert not optimizer.steering.held
    synchronous = optimizer.synchronous_steps
    step(next(batches))
    assert optimizer.synchronous_steps == synchronous + 1


def test_a_failed_choice_gives_back_the_interval_set_before():
    _, optimizer, step, batches = traced_synchronous_loop()
    optimizer.interval = 4

    def one_step_too_many():
        step(next(batches))
        step(next(batches))

    with pytest.raises(ValueError, match="ran more"):
        keras_skip.choose_interval(optimizer, one_step_too_many, steps=1)
    assert optimizer.interval_decision is None
    assert optimizer.interval == optimizer.steering.interval_now() == 4


def test_interval_set_during_an_override_applies_when_it_ends():
    _, optimizer, _, _ = traced_synchronous_loop()
    optimizer.interval = 4
    optimizer.steering.hold(2)
    assert optimizer.steering.interval_now() == 2
    optimizer.interval = 6  # e.g. a callback, between steps
    assert optimizer.interval == 6
    assert optimizer.steering.interval_now() == 2  # the override still holds
    optimizer.steering.release()
    assert optimizer.steering.interval_now() == 6 and optimizer.interval == 6


def test_interval_probe_refuses_calls_out_of_order():
    from keras_skip.adaptive import IntervalDecision, IntervalProbe

    _, optimizer, _, _ = traced_synchronous_loop()
    probe = IntervalProbe(optimizer, 1, 1.0, 8)
    with pytest.raises(RuntimeError, match=r"finish\(\) called without start\(\)"):
        probe.finish()
    probe.decision = IntervalDecision(2, 0.01, 0.02)
    with pytest.raises(RuntimeError, match=r"start\(\) after the decision"):
        probe.start()
    assert not optimizer.steering.held
