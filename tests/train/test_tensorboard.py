"""TensorBoard scalars: a resumed leg replaces what a crashed leg logged past its checkpoint."""

from glm5_jax.train.tensorboard import SummaryWriter, read_scalars


def test_resumed_leg_purges_steps_logged_after_the_checkpoint(tmp_path):
    crashed = SummaryWriter(tmp_path, first_step=1)
    for step in range(1, 6):  # logged steps 1..5, but the last checkpoint was step 2
        crashed.scalars(step, {"loss": 10.0 - step, "lr": 0.1})
    crashed.close()
    resumed = SummaryWriter(tmp_path, first_step=3)
    for step in range(3, 7):
        resumed.scalars(step, {"loss": 100.0 + step, "lr": 0.1})
    resumed.close()
    loss = [(step, value) for step, tag, value in read_scalars(tmp_path) if tag == "loss"]
    assert loss == [(1, 9.0), (2, 8.0), (3, 103.0), (4, 104.0), (5, 105.0), (6, 106.0)]
    assert len(list(tmp_path.iterdir())) == 2  # two legs in the same second keep separate files


def test_corrupt_event_file_is_named(tmp_path):
    writer = SummaryWriter(tmp_path)
    writer.scalars(1, {"loss": 1.0})
    writer.close()
    path = next(tmp_path.iterdir())
    data = bytearray(path.read_bytes())
    data[-6] ^= 0xFF
    path.write_bytes(bytes(data))
    try:
        read_scalars(tmp_path)
    except ValueError as err:
        assert path.name in str(err)
    else:
        raise AssertionError("a corrupt record was read without error")
