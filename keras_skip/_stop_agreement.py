"""The stop agreement: with several workers, all stop training at the same step."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_skip import _compat, multi_worker


def votes(strategy) -> tuple:
    """The variable holding this worker's stop vote under several workers
    (not an optimizer variable: not saved, and 0 outside a request), or
    none."""
    if not _compat.is_multi_worker(strategy):
        return ()
    with strategy.scope():
        vote = tf.Variable(
            0.0,
            trainable=False,
            name="stop_vote",
            aggregation=tf.VariableAggregation.NONE,
        )
    return (vote,)


class StopAgreement(keras.callbacks.Callback):
    """With several workers, makes every worker stop training at the same step.

    Each worker's callbacks see that worker's own batch logs, so a callback
    may set `model.stop_training` on one worker only (`TerminateOnNaN`
    seeing a NaN there); a worker leaving the loop alone would leave the
    others waiting in their next average. This callback runs last: it takes
    the request back and casts this worker's vote, which the next
    synchronization (an average, or a synchronous step) carries to every
    worker with no extra message. Every worker then sees the same votes after
    the same execution of the train function and stops there. At an epoch's
    end, where callbacks such as `EarlyStopping` decide, one all-reduce of a
    few bytes settles the votes at once.
    """

    def __init__(self, optimizer):
        super().__init__()
        self._optimizer = optimizer
        self._voted_at: int | None = None
        self._agreed = False

    def on_train_batch_end(self, batch, logs=None):
        steering = self._optimizer.steering
        if self._agreed:
            self.model.stop_training = True
            return
        if self.model.stop_training:
            self.model.stop_training = False
            if self._voted_at is None:
                steering.vote_stop()
                self._voted_at = steering.counters().synchronizations
        if steering.stop_votes() > 0 and (
            self._voted_at is None
            or steering.counters().synchronizations > self._voted_at
        ):
            self._agreed = self.model.stop_training = True

    def on_epoch_end(self, epoch, logs=None):
        if self._agreed:
            self.model.stop_training = True
            return
        wants = self.model.stop_training or self._voted_at is not None
        votes = multi_worker.sum_over_workers(
            self._optimizer.steering.strategy, [1.0 if wants else 0.0]
        )
        self._agreed = self.model.stop_training = bool(votes[0] > 0)

    def finish(self) -> None:
        """Clears this worker's vote, for a later `fit`."""
        self._optimizer.steering.vote_stop(False)
        self._voted_at = None
        self._agreed = False
