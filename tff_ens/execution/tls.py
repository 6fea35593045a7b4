"""Mutual TLS between a driver and TFF worker services: credentials and the worker's TLS end.

A credentials directory (`make`, `python -m tff_ens.credentials`) holds a certificate
authority of its own, `ca.pem`; a worker certificate, `worker.pem` and `worker.key`, for the
hosts the workers serve as (serverAuth); and a driver certificate, `driver.pem` and
`driver.key` (clientAuth), all ECDSA P-256 and made with the `cryptography` package. The CA's
key is not kept: a new host needs new credentials. A worker service needs `ca.pem` and the
worker pair, a driver `ca.pem` and the driver pair; each side accepts only a peer whose
certificate that CA signed for the peer's role.

`forwarding_server` is a worker service's TLS end (`worker_service`): a gRPC server that
requires and verifies the driver's certificate and forwards TFF's executor calls, bytes
unparsed, to the worker's own socket, which nothing else reaches.
"""

from collections.abc import Sequence
import concurrent.futures
import dataclasses
import datetime
import ipaddress
import os

from cryptography import exceptions
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.oid import NameOID
import grpc

CA_FILE = "ca.pem"
# The certificate and key files of each role.
ROLES = {"worker": ExtendedKeyUsageOID.SERVER_AUTH, "driver": ExtendedKeyUsageOID.CLIENT_AUTH}
# Names every worker certificate holds besides the hosts asked for: SSH tunnels and tests
# reach a worker as localhost.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
VALID_DAYS = 365
MAKE_COMMAND = "python -m tff_ens.credentials --dir=DIR --hosts=WORKER_HOST,..."
# As TFF's `executor_factory.py`: messages up to 2 GB.
_MAX_MESSAGE_BYTES = 2 * 1000 * 1000 * 1000
GRPC_OPTIONS = [
  ("grpc.max_message_length", _MAX_MESSAGE_BYTES),
  ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
  ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
]
EXECUTOR_SERVICE = "/tensorflow_federated.v0.ExecutorGroup/"
# Calls the TLS end forwards at once: TFF's mergeable context sends a worker's calls of
# several computations concurrently, each of which may wait a round on the worker.
_FORWARDED_AT_ONCE = 32


class CredentialsError(ValueError):
  """Credentials missing, unreadable, or not signed by the directory's CA."""


def _name(common_name: str) -> x509.Name:
  return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(host: str) -> x509.GeneralName:
  try:
    return x509.IPAddress(ipaddress.ip_address(host))
  except ValueError:
    return x509.DNSName(host)


def _certificate(subject, public_key, issuer, issuer_key, extensions, now) -> x509.Certificate:
  builder = (
    x509.CertificateBuilder()
    .subject_name(subject)
    .issuer_name(issuer)
    .public_key(public_key)
    .serial_number(x509.random_serial_number())
    .not_valid_before(now - datetime.timedelta(hours=1))  # Clocks a little apart.
    .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
  )
  for extension, critical in extensions:
    builder = builder.add_extension(extension, critical=critical)
  return builder.sign(issuer_key, hashes.SHA256())


def _write(path: str, data: bytes, mode: int) -> None:
  """Writes a new file; never replaces one."""
  with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
    f.write(data)


def make(directory: str, hosts: Sequence[str]) -> list[str]:
  """Writes a CA, a worker certificate for `hosts` and a driver certificate in `directory`
  (created if missing); returns the paths written. Keys are readable by their owner only.

  Raises:
    CredentialsError: if the directory already holds any of the files (nothing is written).
  """
  files = [CA_FILE] + [f"{role}.{kind}" for role in ROLES for kind in ("pem", "key")]
  os.makedirs(directory, mode=0o700, exist_ok=True)
  existing = [f for f in files if os.path.exists(os.path.join(directory, f))]
  if existing:
    raise CredentialsError(
      f"{os.path.join(directory, existing[0])} exists: choose a new --dir, or remove the old "
      "credentials first (every worker and driver then needs the new ones)"
    )
  now = datetime.datetime.now(datetime.timezone.utc)
  ca_key = ec.generate_private_key(ec.SECP256R1())
  ca_name = _name("tff-ens CA")
  ca = _certificate(
    ca_name,
    ca_key.public_key(),
    ca_name,
    ca_key,
    [
      (x509.BasicConstraints(ca=True, path_length=0), True),
      (x509.KeyUsage(False, False, False, False, False, True, True, False, False), True),
    ],
    now,
  )  # KeyUsage: keyCertSign and cRLSign only.
  written = {CA_FILE: ca.public_bytes(serialization.Encoding.PEM)}
  names = {"worker": [*dict.fromkeys([*hosts, *LOOPBACK_NAMES])], "driver": []}
  for role, usage in ROLES.items():
    key = ec.generate_private_key(ec.SECP256R1())
    extensions = [
      (x509.BasicConstraints(ca=False, path_length=None), True),
      (x509.KeyUsage(True, False, False, False, False, False, False, False, False), True),
      (x509.ExtendedKeyUsage([usage]), False),
    ]
    if names[role]:
      extensions.append((x509.SubjectAlternativeName([_san(h) for h in names[role]]), False))
    cert = _certificate(
      _name(f"tff-ens {role}"), key.public_key(), ca_name, ca_key, extensions, now
    )
    written[f"{role}.pem"] = cert.public_bytes(serialization.Encoding.PEM)
    written[f"{role}.key"] = key.private_bytes(
      serialization.Encoding.PEM,
      serialization.PrivateFormat.PKCS8,
      serialization.NoEncryption(),
    )
  paths = []
  for name, data in written.items():
    paths.append(os.path.join(directory, name))
    _write(paths[-1], data, 0o600 if name.endswith(".key") else 0o644)
  return paths


@dataclasses.dataclass(frozen=True)
class Credentials:
  """One role's files from a credentials directory, checked against its CA."""

  ca: bytes
  certificate: bytes
  key: bytes


def load(directory: str, role: str) -> Credentials:
  """`ca.pem` and the `role`'s pair from `directory`.

  Raises:
    CredentialsError: one line naming the file and the fix, for a missing or unreadable
      file, a certificate that the directory's CA did not sign, or one out of its dates.
  """
  paths = [os.path.join(directory, f) for f in (CA_FILE, f"{role}.pem", f"{role}.key")]
  try:
    ca, certificate, key = (open(p, "rb").read() for p in paths)
  except OSError as e:
    raise CredentialsError(
      f"{e.filename} cannot be read ({e.strerror}): make the credentials with `{MAKE_COMMAND}`"
    ) from None
  try:
    cert = x509.load_pem_x509_certificate(certificate)
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
  except (ValueError, TypeError, exceptions.InvalidSignature) as e:
    raise CredentialsError(
      f"{paths[1]} is not a certificate that {paths[0]} signed ({e}): use the files of one "
      f"`{MAKE_COMMAND}` together"
    ) from None
  now = datetime.datetime.now(datetime.timezone.utc)
  if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
    raise CredentialsError(
      f"{paths[1]} is valid from {cert.not_valid_before_utc:%Y-%m-%d} to "
      f"{cert.not_valid_after_utc:%Y-%m-%d}: make new credentials with `{MAKE_COMMAND}`"
    )
  return Credentials(ca, certificate, key)


def channel_credentials(directory: str) -> grpc.ChannelCredentials:
  """A driver's side: it verifies the worker's certificate and presents its own."""
  driver = load(directory, "driver")
  return grpc.ssl_channel_credentials(driver.ca, driver.key, driver.certificate)


def server_credentials(directory: str) -> grpc.ServerCredentials:
  """A worker service's side: it serves only drivers with a certificate its CA signed."""
  worker = load(directory, "worker")
  return grpc.ssl_server_credentials(
    [(worker.key, worker.certificate)], root_certificates=worker.ca, require_client_auth=True
  )


def is_local(address: str) -> bool:
  """Whether a gRPC target is a Unix-domain socket or a loopback host ("host:port")."""
  if address.startswith("unix:"):
    return True
  host = address.rpartition(":")[0].strip("[]")
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def _forwarder(upstream: grpc.Channel, method: str):
  """A unary handler that sends the request's bytes to the worker and returns its answer,
  or its gRPC status."""
  call = upstream.unary_unary(method)  # No (de)serializers: bytes pass through.

  def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
    try:
      return call(request)
    except grpc.RpcError as e:
      context.abort(e.code(), e.details() or "")

  return grpc.unary_unary_rpc_method_handler(forward)


class _Forwarding(grpc.GenericRpcHandler):
  """TFF's executor service, answered by the worker behind `upstream`; nothing else."""

  def __init__(self, upstream: grpc.Channel):
    self._upstream = upstream
    self._handlers = {}

  def service(self, handler_call_details):
    method = handler_call_details.method
    if not method.startswith(EXECUTOR_SERVICE):
      return None  # UNIMPLEMENTED.
    if method not in self._handlers:
      self._handlers[method] = _forwarder(self._upstream, method)
    return self._handlers[method]


def forwarding_server(
  upstream: str, port: int, credentials_dir: str | None, *, host: str
) -> tuple[grpc.Server, grpc.Channel]:
  """Starts a gRPC server on `host:port` that forwards TFF's executor calls to `upstream`.

  With `credentials_dir`, it serves TLS and only drivers whose certificate the
  directory's CA signed; with None, plaintext, allowed only on a loopback `host`.
  Returns the server and its channel to the worker: stop the one, then close the other.

  Raises:
    CredentialsError: for bad credentials.
    ValueError: for plaintext on a host that is not loopback.
    OSError: if the port cannot be bound (in use).
  """
  if credentials_dir is None and not is_local(f"{host}:{port}"):
    raise ValueError(f"plaintext on {host}: serve TLS (credentials) or bind a loopback host")
  server_creds = None if credentials_dir is None else server_credentials(credentials_dir)
  channel = grpc.insecure_channel(upstream, GRPC_OPTIONS)
  server = grpc.server(
    concurrent.futures.ThreadPoolExecutor(max_workers=_FORWARDED_AT_ONCE),
    handlers=[_Forwarding(channel)],
    # A busy port is an error, not a port shared with its other listener.
    options=[*GRPC_OPTIONS, ("grpc.so_reuseport", 0)],
  )
  try:
    address = f"{host}:{port}"
    bound = (
      server.add_insecure_port(address)
      if server_creds is None
      else server.add_secure_port(address, server_creds)
    )
  except RuntimeError:
    bound = 0
  if not bound:
    channel.close()
    raise OSError(f"port {port} is in use: choose another --port")
  server.start()
  return server, channel
