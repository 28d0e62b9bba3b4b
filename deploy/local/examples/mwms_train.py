"""A small MultiWorkerMirroredStrategy training run, with no TF_CONFIG code.

tfimage sets TF_CONFIG for every task of the step; this script only builds the
strategy.  Each worker trains on its shard of a fixed data set and prints its
first and last loss and a checksum of the final weights: every worker of one run
must print the same checksum.
"""

import hashlib
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # Keras 3 fit() fails under MWMS

import numpy as np
import tensorflow as tf
import tf_keras as keras

STEPS, BATCH, FEATURES = 40, 64, 16

strategy = tf.distribute.MultiWorkerMirroredStrategy(
    communication_options=tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING
    )
)
cluster = json.loads(os.environ["TF_CONFIG"])
index = cluster["task"]["index"]
workers = len(cluster["cluster"]["worker"])

rng = np.random.default_rng(0)
x = rng.normal(size=(BATCH * workers, FEATURES)).astype("float32")
y = (x @ np.linspace(-1, 1, FEATURES).astype("float32") + 0.5).astype("float32")
xs, ys = x[index::workers], y[index::workers]  # this worker's shard

with strategy.scope():
    w = tf.Variable(tf.zeros([FEATURES]))
    b = tf.Variable(0.0)
    opt = keras.optimizers.SGD(learning_rate=0.1)


@tf.function
def train_step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
    def replica(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            err = tf.linalg.matvec(xb, w) + b - yb
            loss = tf.reduce_sum(err * err) / (BATCH * workers)  # global mean
        grads = tape.gradient(loss, [w, b])
        opt.apply_gradients(zip(grads, [w, b], strict=True))  # all-reduced across workers
        return loss

    per = strategy.run(replica, args=(xb, yb))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, per, axis=None)


losses = [float(train_step(xs, ys)) for _ in range(STEPS)]
final = np.concatenate([w.numpy(), [b.numpy()]]).astype("float32")
digest = hashlib.sha256(final.tobytes()).hexdigest()[:16]
print(
    f"WORKER {index}/{workers} host={os.environ.get('SLURMD_NODENAME')} "
    f"loss {losses[0]:.5f} -> {losses[-1]:.5f} weights {digest}",
    flush=True,
)
