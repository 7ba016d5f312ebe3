"""The train function and the logs: each step's logs kept on the worker,
the epoch's metrics gathered in one all-reduce, metrics reset without
collectives."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_skip._compat.originals import _KERAS, is_multi_worker, skip_optimizer


def _get_metrics_result_or_logs(self, logs):
    optimizer = skip_optimizer(getattr(self, "optimizer", None))
    if optimizer is None:
        return type(self)._get_metrics_result_or_logs(self, logs)
    if not optimizer.showing_latest_averages:
        # An epoch whose end no batch could tell (data of unknown length).
        optimizer.average()
    strategy = self.distribute_strategy
    if not is_multi_worker(strategy):
        return type(self)._get_metrics_result_or_logs(self, logs)
    # As Keras does, with the metrics' global values gathered in one
    # all-reduce instead of one per metric variable.
    metric_logs = global_metrics_result(self, strategy)
    if isinstance(logs, dict) and set(logs) == set(metric_logs):
        return metric_logs
    return logs


def _reset_metrics(self):
    reset = type(self).reset_metrics  # the model class's own, or Keras'
    strategy = self.distribute_strategy
    context = tf.distribute.get_replica_context()
    if not is_multi_worker(strategy) or (
        context is not None and context.strategy is strategy
    ):
        return reset(self)
    strategy.run(lambda: reset(self))


def global_metrics_result(model: keras.Model, strategy) -> dict:
    """``model.get_metrics_result()`` over every replica of every worker,
    from one all-reduce of the metric variables' per-worker values.

    Keras reads each metric variable (``synchronization="on_read"``) in
    cross-replica context, one all-reduce per variable. Here each worker
    combines its own replicas' copies as the variable's aggregation says,
    the workers' values travel together, and the results come from
    ``Metric.stateless_result`` (keras 3.15).
    """
    from keras_skip import multi_worker

    metrics = model.metrics
    variables = [v for metric in metrics for v in metric.variables]
    workers = multi_worker.num_workers(strategy)
    first = multi_worker.worker_index(strategy) == 0
    parts, shapes = [], []
    for v in variables:
        copies = [c.numpy() for c in strategy.experimental_local_results(v.value)]
        aggregation = str(v.aggregation).lower()
        if "mean" in aggregation:
            value = np.mean(copies, axis=0) / workers
        elif "first" in aggregation:
            value = copies[0] if first else np.zeros_like(copies[0])
        else:  # sum
            value = np.sum(copies, axis=0)
        shapes.append(np.shape(copies[0]))
        parts.append(np.asarray(value, np.float64).ravel())
    total = multi_worker.sum_over_workers(
        strategy, np.concatenate(parts) if parts else np.zeros(0)
    )
    values, offset = [], 0
    for v, shape in zip(variables, shapes, strict=True):
        size = int(np.prod(shape, dtype=np.int64))
        value = total[offset : offset + size].reshape(shape)
        values.append(tf.constant(value, dtype=v.dtype))
        offset += size
    results, offset = {}, 0
    for metric in metrics:
        count = len(metric.variables)
        result = metric.stateless_result(values[offset : offset + count])
        offset += count
        if isinstance(result, dict):
            results.update(result)
        else:
            results[metric.name] = result
    return results


def _reduce_per_replica(values, strategy, reduction):
    if reduction not in ("auto", "mean") or not is_multi_worker(strategy):
        return _KERAS["reduce_per_replica"](values, strategy, reduction)
    from keras.src import tree

    def reduce(value):
        component = (
            value.values[0]
            if isinstance(value, tf.distribute.DistributedValues)
            else value
        )
        axis = None if component.shape.rank == 0 else 0
        return strategy.reduce("MEAN", value, axis=axis)

    return tree.map_structure(reduce, values)


def _local_logs(values, strategy):
    """Each log averaged over this worker's replicas only: no collective."""
    from keras.src import tree

    def reduce(value):
        if not isinstance(value, tf.distribute.DistributedValues):
            return value
        copies = strategy.experimental_local_results(value)
        return tf.reduce_mean(tf.stack(copies), axis=0)

    return tree.map_structure(reduce, values)


def _make_function(self, step_function):
    if getattr(step_function, "__name__", None) != "train_step":
        return _train_or_test_function(self, step_function)
    model = self
    graphs = []
    # One function per branch its steps take (see `_step`), each traced at
    # its first use, so most fits trace one branch; once the function with
    # the condition (None) exists, it serves every execution.
    functions = {}

    def function_for(branch):
        if branch not in functions:
            functions[branch] = _train_or_test_function(model, step_function, graphs)
        return functions[branch]

    def train_function(iterator):
        optimizer = skip_optimizer(getattr(model, "optimizer", None))
        step = getattr(optimizer, "_step", None)
        # Delayed averages (overlap >= 2) land and start between executions.
        flight = getattr(optimizer, "_flight", None)
        if flight is not None:
            flight.before_execution(model.steps_per_execution)
        try:
            if step is None:
                return function_for(None)(iterator)
            branch = None if None in functions else step.branch_of_next_execution()
            with step.taking(branch):
                return function_for(branch)(iterator)
        finally:
            if flight is not None:
                flight.after_execution()

    #: The graphs of one step and of one execution, as traced by every
    #: branch's function (tests inspect their collectives).
    train_function.traced_graphs = graphs
    return train_function


def _train_or_test_function(self, step_function, graphs=None):
    strategy = self.distribute_strategy
    steps_per_execution = self.steps_per_execution
    if strategy.num_replicas_in_sync == 1 or (
        steps_per_execution == 1
        and not is_multi_worker(strategy)
        and not _delays_averages(self)
    ):
        return _KERAS["_make_function"](self, step_function)
    graphs = [] if graphs is None else graphs
    one_step_on_data = _one_step_function(
        self, step_function, _logs_reduction(self), graphs
    )
    multi_step_on_iterator = _multi_step_function(self, one_step_on_data, graphs)

    def function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            outputs = multi_step_on_iterator(iterator)
            if not outputs.has_value():
                raise StopIteration
            return outputs.get_value()
        outputs = None
        for _, data in zip(range(steps_per_execution), iterator, strict=False):
            outputs = one_step_on_data(data)
        return outputs

    #: The graphs of one step and of one execution, as traced (tests inspect
    #: their collectives).
    function.traced_graphs = graphs
    return function


def _delays_averages(model) -> bool:
    """Whether the model's optimizer delays averages (``overlap >= 2``): its
    all-reduce then runs beside the steps, which must exchange nothing (the
    logs of Keras' own function are reduced by a collective)."""
    optimizer = skip_optimizer(getattr(model, "optimizer", None))
    return getattr(optimizer, "_overlap_steps", 0) >= 2


def _logs_reduction(model):
    """How the train and test functions reduce a step's logs over the
    replicas: ``reduce_logs(values, strategy)``."""
    # A model compiled with SkipCorrectionOptimizer keeps each step's logs on
    # the worker: reducing them across workers would make every local step
    # wait for the slowest worker. The epoch's logs are global (see
    # `global_metrics_result`).
    if skip_optimizer(getattr(model, "optimizer", None)) is not None:
        return _local_logs
    return lambda values, strategy: _reduce_per_replica(values, strategy, "auto")


def _one_step_function(model, step_function, reduce_logs, graphs):
    """One step on one batch on every replica, its logs reduced with
    `reduce_logs`; a `tf.function` unless the model runs eagerly. Each graph
    it is traced in is appended to `graphs`."""
    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        graphs.append(tf.compat.v1.get_default_graph())
        outputs = strategy.run(step_function, args=(data,))
        return reduce_logs(outputs, strategy)

    if not model.run_eagerly:
        one_step_on_data = tf.function(
            one_step_on_data, reduce_retracing=True, jit_compile=model.jit_compile
        )
    return model._autoconvert_optionals(one_step_on_data)


def _multi_step_function(model, one_step_on_data, graphs):
    """One execution: up to ``steps_per_execution`` calls of
    `one_step_on_data` in a ``tf.while_loop`` that calls the step directly,
    not inside a ``tf.cond``, and stops when the iterator runs out. Returns
    the last step's logs as a ``tf.experimental.Optional``, empty when no
    step ran; a `tf.function` unless the model runs eagerly. Each graph it is
    traced in is appended to `graphs`."""
    steps_per_execution = model.steps_per_execution

    @tf.autograph.experimental.do_not_convert
    def multi_step_on_iterator(iterator):
        graphs.append(tf.compat.v1.get_default_graph())
        if steps_per_execution == 1:
            return tf.experimental.Optional.from_value(
                one_step_on_data(iterator.get_next())
            )
        empty_outputs = tf.experimental.Optional.empty(None)

        def condition(step, outputs, next_inputs):
            return tf.logical_and(
                tf.less(step, steps_per_execution), next_inputs.has_value()
            )

        def body(step, outputs, next_inputs):
            outputs = tf.experimental.Optional.from_value(
                one_step_on_data(next_inputs.get_value())
            )
            empty_outputs._element_spec = outputs.element_spec
            next_inputs = tf.cond(
                tf.less(step + 1, steps_per_execution),
                iterator.get_next_as_optional,
                lambda: next_inputs,
            )
            return step + 1, outputs, next_inputs

        _, outputs, _ = tf.while_loop(
            condition,
            body,
            [tf.constant(0), empty_outputs, iterator.get_next_as_optional()],
        )
        outputs._element_spec = empty_outputs.element_spec
        return outputs

    if not model.run_eagerly:
        multi_step_on_iterator = tf.function(
            multi_step_on_iterator, reduce_retracing=True
        )
    return multi_step_on_iterator
