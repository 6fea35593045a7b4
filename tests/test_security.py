"""Closed doors: a run's worker is reachable by the run alone; worker services by verified
drivers alone.

Real workers and real computations: the local worker has no TCP listener on this machine
and its socket refuses another user; where namespaces cannot be made (a seccomp filter
refusing unshare, as container runtimes have) starting it fails in one line naming the
fix; an isolated worker computes the same bytes as an open one; a worker service refuses a
plaintext driver, a driver without a certificate, one whose certificate another CA signed
and one presenting a worker's certificate, and serves one with the right credentials.
"""

import dataclasses
import os
import platform
import socket
import subprocess
import sys
import textwrap

import grpc
import numpy as np
import psutil
import pytest
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.proto.v0 import executor_pb2
from tensorflow_federated.python.core.impl.executors import value_serialization

from tests import worker_processes
from tests.femnist_runs import QUICK
from tests.femnist_runs import ROOT
from tff_ens import algorithms
from tff_ens.execution import runtime
from tff_ens.execution import tls
from tff_ens.execution import worker_process
from tff_ens.program import experiment
from tff_ens.program import training
from tff_ens.templates import client_work
from tiny import CLIENT_DATA
from tiny import SPEC
from tiny import one_batch
from tiny import tiny_model

no_stray_workers = worker_processes.no_stray_workers
credentials = worker_processes.credentials
tls_workers = worker_processes.tls_workers


def _listening_ports(pids: set[int]) -> list:
  """The TCP sockets of `pids` that listen, on this machine's network."""
  return [
    c.laddr
    for c in psutil.net_connections(kind="inet")
    if c.status == psutil.CONN_LISTEN and c.pid in pids
  ]


def test_the_local_worker_listens_on_no_port_and_its_socket_is_its_users():
  with runtime.execution_context():
    assert worker_processes.sum_of_doubles([1, 2, 3]) == 12
    (worker,) = worker_processes.descendants()
    tree = {p.pid for p in [psutil.Process(), *psutil.Process().children(recursive=True)]}
    assert worker.pid in tree
    assert _listening_ports(tree) == []
    # Its one way in: a socket in a directory that only this user can enter.
    address = runtime.current_worker().address
    assert address.startswith("unix:")
    directory = os.path.dirname(address.removeprefix("unix:"))
    assert os.stat(directory).st_mode & 0o777 == 0o700
    assert os.stat(directory).st_uid == os.getuid()
  assert not os.path.exists(directory)


def test_an_open_worker_listens_on_a_tcp_port():
  # The check above can fail: a worker started open (as TFF starts it) is found listening.
  worker = worker_process.start_worker(isolation="open")
  worker_processes.SEEN_PIDS.add(worker.pid)
  try:
    with runtime.execution_context(workers=[worker.address]):
      assert worker_processes.sum_of_doubles([1, 2]) == 6
      port = int(worker.address.rpartition(":")[2])
      assert port in [a.port for a in _listening_ports({worker.pid})]
  finally:
    worker_process.stop_worker(worker)


_OTHER_USER = 65534  # nobody


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_another_user_cannot_reach_the_local_workers_socket():
  with runtime.execution_context():
    assert worker_processes.sum_of_doubles([1]) == 2
    path = runtime.current_worker().address.removeprefix("unix:")
    script = textwrap.dedent(f"""
      import os, socket, sys
      os.setgroups([]); os.setgid({_OTHER_USER}); os.setuid({_OTHER_USER})
      s = socket.socket(socket.AF_UNIX)
      try:
        s.connect({path!r})
      except PermissionError:
        sys.exit(13)
      sys.exit(0)
    """)
    refused = subprocess.run([sys.executable, "-I", "-S", "-c", script], timeout=60)
    # And root, which may, reaches the worker: the socket is the worker's.
    with socket.socket(socket.AF_UNIX) as s:
      s.connect(path)
  assert refused.returncode == 13


# A seccomp filter that fails unshare(2) with EPERM, as container runtimes' default profiles
# do for unprivileged callers: installed in a child Python before it starts a worker.
_UNSHARE = {"x86_64": 272, "aarch64": 97}


def _no_unshare_preamble() -> str:
  nr = _UNSHARE[platform.machine()]
  return textwrap.dedent(f"""
    import ctypes, struct
    libc = ctypes.CDLL(None, use_errno=True)
    code = [(0x20, 0, 0, 0), (0x15, 0, 1, {nr}), (0x06, 0, 0, 0x00050001),
            (0x06, 0, 0, 0x7fff0000)]  # ld nr; jeq unshare; ret ERRNO(EPERM); ret ALLOW
    program = b"".join(struct.pack("HBBI", *c) for c in code)
    buffer = ctypes.create_string_buffer(program)
    fprog = struct.pack("HxxxxxxP", len(code), ctypes.addressof(buffer))
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0  # SECCOMP_MODE_FILTER
  """)


@pytest.mark.skipif(platform.machine() not in _UNSHARE, reason="unshare's number unknown here")
def test_without_namespaces_the_local_worker_fails_in_one_line_naming_the_fix():
  script = _no_unshare_preamble() + textwrap.dedent("""
    from tff_ens.execution import worker_process
    try:
      worker_process.start_worker()
    except worker_process.IsolationError as e:
      print(e)
    worker = worker_process.start_worker(isolation="open")  # What the fix offers.
    worker_process.stop_worker(worker)
    print("open: started")
  """)
  out = subprocess.run(
    [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr[-2000:]
  message, opened = out.stdout.splitlines()
  assert message.startswith(
    "cannot isolate the local TFF worker in a network namespace of its "
    "own (unshare(CLONE_NEWUSER|CLONE_NEWNET): Operation not permitted)"
  )
  assert "sysctl kernel.unprivileged_userns_clone=1" in message
  assert opened == "open: started"


def test_a_run_without_namespaces_is_a_usage_error_naming_local_worker_open(monkeypatch):
  # The CLI's error (`training`): the isolation error and the flag that accepts an open
  # worker, in one line.
  def fail(**kwargs):
    raise worker_process.IsolationError("cannot isolate the local TFF worker (why): fix")

  monkeypatch.setattr(worker_process, "start_worker", fail)
  run = experiment.resolve(dataclasses.replace(QUICK, output_dir="unused"))
  with pytest.raises(experiment.UsageError) as raised:
    with training._execution_context(run):
      pass
  assert str(raised.value).startswith(
    "cannot isolate the local TFF worker (why): fix; or pass --local_worker=open"
  )


def test_an_isolated_worker_computes_the_same_bytes_as_an_open_one():
  algorithm = algorithms.build_algorithm(
    "fedensemble",
    lambda k=0: tiny_model(seed=10 * k),
    SPEC,
    client_work.LocalTrainingConfig(learning_rate=0.5),
    seed=1,
    clients_per_round=3,
    ensemble_size=2,
  )
  datasets = [one_batch(x, y) for x, y in CLIENT_DATA]
  results = {}
  for isolation in worker_process.ISOLATIONS:
    with runtime.execution_context(local_worker=isolation):
      state = algorithm.process.initialize()
      for _ in range(2):
        state, output = algorithm.next_fn(state, datasets, np.array([4, 1, 2]))
      results[isolation] = (algorithm.models_fn(state), output.metrics)
  flat = [tf.nest.flatten(results[i]) for i in worker_process.ISOLATIONS]
  assert len(flat[0]) == len(flat[1]) > 4
  for a, b in zip(*flat):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def _executor_call(channel: grpc.Channel):
  """TFF's GetExecutor for one client, as a driver's first call; raises grpc.RpcError."""
  request = executor_pb2.GetExecutorRequest(
    cardinalities=value_serialization.serialize_cardinalities({tff.CLIENTS: 1})
  )
  return channel.unary_unary(tls.EXECUTOR_SERVICE + "GetExecutor")(
    request.SerializeToString(), timeout=20
  )


def test_a_worker_service_serves_only_drivers_with_a_certificate_its_ca_signed(
  tls_workers, credentials, tmp_path
):
  (address, _), _ = tls_workers
  tls.make(str(tmp_path / "other"), [])
  ours, other = tls.load(credentials, "driver"), tls.load(str(tmp_path / "other"), "driver")
  worker = tls.load(credentials, "worker")
  refused = {
    "plaintext": grpc.insecure_channel(address),
    "no certificate": grpc.secure_channel(address, grpc.ssl_channel_credentials(ours.ca)),
    "another CA's": grpc.secure_channel(
      address, grpc.ssl_channel_credentials(ours.ca, other.key, other.certificate)
    ),
    "a worker's certificate": grpc.secure_channel(
      address, grpc.ssl_channel_credentials(ours.ca, worker.key, worker.certificate)
    ),
  }
  codes = {}
  for name, channel in refused.items():
    with channel:
      with pytest.raises(grpc.RpcError) as error:
        _executor_call(channel)
      codes[name] = error.value.code()
  assert codes == {name: grpc.StatusCode.UNAVAILABLE for name in refused}
  with grpc.secure_channel(address, tls.channel_credentials(credentials)) as channel:
    assert _executor_call(channel)  # The worker's executor id: served.


def test_a_driver_refuses_a_worker_it_cannot_verify(tls_workers, credentials, tmp_path):
  (address, _), _ = tls_workers
  port = address.rpartition(":")[2]
  tls.make(str(tmp_path / "other"), [])
  ours, other = tls.load(credentials, "driver"), tls.load(str(tmp_path / "other"), "driver")
  refused = {
    # The driver's own certificate is good; it trusts another CA.
    "another CA's worker": (address, other.ca),
    # The worker's certificate names localhost and 127.0.0.1, not 127.0.0.2.
    "a host its certificate does not name": (f"127.0.0.2:{port}", ours.ca),
  }
  codes = {}
  for name, (target, ca) in refused.items():
    creds = grpc.ssl_channel_credentials(ca, ours.key, ours.certificate)
    with grpc.secure_channel(target, creds) as channel:
      with pytest.raises(grpc.RpcError) as error:
        _executor_call(channel)
      codes[name] = error.value.code()
  assert codes == {name: grpc.StatusCode.UNAVAILABLE for name in refused}


def test_a_driver_without_credentials_does_not_reach_a_remote_worker():
  with pytest.raises(tls.CredentialsError, match="10.0.0.2:8000 is reached over the network"):
    with runtime.execution_context(workers=["10.0.0.2:8000"]):
      pytest.fail("entered the block")
  config = dataclasses.replace(QUICK, workers="10.0.0.2:8000,127.0.0.1:8001")
  with pytest.raises(experiment.UsageError, match="pass --worker_credentials=DIR") as error:
    config.validate()
  assert "\n" not in str(error.value)


def test_credentials_never_replace_files_and_keep_keys_private(credentials):
  with pytest.raises(tls.CredentialsError, match="exists: choose a new --dir"):
    tls.make(credentials, ["10.0.0.2"])
  modes = {
    name: os.stat(os.path.join(credentials, name)).st_mode & 0o777
    for name in os.listdir(credentials)
  }
  assert modes == {
    "ca.pem": 0o644,
    "worker.pem": 0o644,
    "driver.pem": 0o644,
    "worker.key": 0o600,
    "driver.key": 0o600,
  }
  assert os.stat(credentials).st_mode & 0o777 == 0o700


def test_mixed_credentials_are_refused_in_one_line(credentials, tmp_path):
  tls.make(str(tmp_path / "other"), [])
  mixed = tmp_path / "mixed"
  mixed.mkdir()
  for name, source in (
    ("ca.pem", credentials),
    ("driver.pem", str(tmp_path / "other")),
    ("driver.key", str(tmp_path / "other")),
  ):
    (mixed / name).write_bytes(open(os.path.join(source, name), "rb").read())
  config = dataclasses.replace(QUICK, workers="10.0.0.2:8000", worker_credentials=str(mixed))
  with pytest.raises(experiment.UsageError) as error:
    config.validate()
  message = str(error.value)
  assert message.startswith(
    f"--worker_credentials={mixed}: {mixed}/driver.pem is not a "
    f"certificate that {mixed}/ca.pem signed"
  )
  assert "\n" not in message
  os.remove(mixed / "driver.key")
  with pytest.raises(experiment.UsageError, match="driver.key cannot be read"):
    config.validate()
