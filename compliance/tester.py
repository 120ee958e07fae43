# SPDX-License-Identifier: Apache-2.0
"""The tester: a MetaRoCE peer played from a raw AF_PACKET socket, and the IUT's agent.

The tester owns one Ethernet port (the end of a veth pair, or any interface that reaches the
IUT's port), answers ARP for its own addresses, sends crafted MetaRoCE packets and records what
the IUT sends. Every frame the IUT sends to a tester address is checked against wire.md as it
arrives (Frame.problems); the suite fails on any.
"""
import json
import os
import random
import select
import socket
import subprocess
import threading
import time

import mrwire as w

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4


class Fail(Exception):
    """A check's finding: the IUT broke the spec section the message names."""


class Skip(Exception):
    pass


class Port:
    """A raw socket on the tester's interface, answering ARP for the tester's addresses."""

    def __init__(self, iface, iut_ip):
        self.iface, self.iut_ip = iface, iut_ip
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.bind((iface, 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        with open(f"/sys/class/net/{iface}/address") as f:
            self.mac = f.read().strip()
        self.ips = set()
        self.iut_mac = None
        self.log = []            # every MetaRoCE frame from the IUT: (time, Frame)
        self.igmp = []           # every IGMP message from the IUT (Frame, with .t)
        self.violations = []     # (time, problem, repr) for frames that break wire.md
        self.handlers = []       # callables(frame, t) for MetaRoCE frames; may send
        self.arp_requests = 0
        self.start()

    def add_ip(self, ip):
        self.ips.add(ip)

    def send(self, frame):
        self.sock.send(frame)

    def send_udp(self, src_ip, sport, payload, dport=w.UDP_PORT, dst_ip=None, **ip_kw):
        pkt = w.ipv4_udp(src_ip, dst_ip or self.iut_ip, sport, dport, payload, **ip_kw)
        self.send(w.ether(self.iut_mac, self.mac, w.ETH_IPV4, pkt))

    def send_mrh(self, src_ip, sport, m, **ip_kw):
        self.send_udp(src_ip, sport, m.encode(), **ip_kw)

    def resolve(self, timeout=5.0):
        """Learns the IUT's MAC by ARP (W§1)."""
        src = sorted(self.ips)[0]
        end = time.monotonic() + timeout
        while self.iut_mac is None and time.monotonic() < end:
            self.send(w.ether("ff:ff:ff:ff:ff:ff", self.mac, w.ETH_ARP,
                              w.arp(1, self.mac, src, "00:00:00:00:00:00", self.iut_ip)))
            self.pump(0.2, until=lambda: self.iut_mac is not None)
        if self.iut_mac is None:
            raise Skip(f"the IUT ({self.iut_ip}) answers no ARP on {self.iface}")

    def start(self):
        """Receives in a thread of its own from now on, so that ARP and the handlers' ACKs go
        out at once whatever the checks are doing (an agent call, a sleep)."""
        self.cv = threading.Condition()
        self.running = True
        self.thread = threading.Thread(target=self._rx_loop, daemon=True)
        self.thread.start()

    def _rx_loop(self):
        # The IUT's timers give the tester about a millisecond to answer; on a busy host a
        # thread of normal priority can wait for the CPU longer than that. This thread sleeps
        # in select() and does bounded work per wake-up, so a low real-time priority costs the
        # others nothing but its own work (root only; otherwise it runs as it is).
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            self.realtime = True
        except (OSError, AttributeError):
            self.realtime = False
        while self.running:
            r, _, _ = select.select([self.sock], [], [], 0.05)
            if not r:
                continue
            # What is queued is taken in one go (at most 64 frames), then every handler that
            # owes replies sends them: one ACK per path per burst, as a receiver does (W§5.2),
            # which keeps a Python tester fast enough for the IUT's timers.
            for _ in range(64):
                try:
                    raw, addr = self.sock.recvfrom(65535, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
                except OSError:
                    return
                if addr[2] == PACKET_OUTGOING:
                    continue
                self._frame(raw, time.monotonic())
            for h in list(self.handlers):
                flush = getattr(h, "__self__", None) and getattr(h.__self__, "flush", None)
                if flush:
                    flush()
            with self.cv:
                self.cv.notify_all()

    def pump(self, timeout, until=None):
        """Waits up to timeout seconds, or until until() is true. Returns until()'s value."""
        end = time.monotonic() + timeout
        with self.cv:
            while True:
                if until is not None and until():
                    return True
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cv.wait(min(left, 0.01))

    def _frame(self, raw, t):
        f = w.Frame(raw)
        if f.kind == "arp":
            if f.arp_spa == self.iut_ip:
                self.iut_mac = f.arp_sha
            if f.arp_op == 1 and f.arp_tpa in self.ips:
                self.arp_requests += 1
                self.send(w.ether(f.src_mac, self.mac, w.ETH_ARP,
                                  w.arp(2, self.mac, f.arp_tpa, f.arp_sha, f.arp_spa)))
            return
        if f.kind == "igmp" and f.src_ip == self.iut_ip:
            f.t = t
            self.igmp.append(f)
            return
        if f.kind not in ("udp", "mrh") or getattr(f, "src_ip", None) != self.iut_ip:
            return
        group = w.is_group(f.dst_ip)   # a multicast datagram (W§8)
        if f.dst_ip not in self.ips and not group:
            return
        if f.kind == "udp":
            self.violations.append((t, f"UDP to port {f.dport}, not {w.UDP_PORT} (W§1)", ""))
            return
        if f.dport != w.UDP_PORT:
            self.violations.append((t, f"destination port {f.dport} (W§1)", repr(f.mrh)))
        if f.mrh.is_data() and f.ecn == 0:
            self.violations.append((t, "data packet not ECN-capable (W§1: ECT(0) on data)",
                                    repr(f.mrh)))
        if group and not f.mrh.is_datagram():
            self.violations.append((t, f"{w.OP_NAMES.get(f.mrh.opcode, f.mrh.opcode)} sent to "
                                    f"the group {f.dst_ip} (W§8: only datagrams)", repr(f.mrh)))
        if f.mrh.is_datagram():
            if not group:
                self.violations.append((t, f"datagram to {f.dst_ip}, not a group (W§8)",
                                        repr(f.mrh)))
            elif f.dst_mac != w.group_mac(f.dst_ip):
                self.violations.append((t, f"datagram to {f.dst_ip} sent to Ethernet "
                                        f"{w.mac_str(f.dst_mac)}, not the group's (W§8)",
                                        repr(f.mrh)))
            if f.ecn != 0:
                self.violations.append((t, f"datagram with ECN {f.ecn}, not Not-ECT (W§8)",
                                        repr(f.mrh)))
            if f.sport >> 14 != 3:
                self.violations.append((t, f"datagram from UDP port {f.sport:#x}, not 0xc000 | "
                                        f"14 bits (W§8)", repr(f.mrh)))
        for p in f.problems:
            self.violations.append((t, p, repr(f.mrh)))
        f.t = t
        self.log.append(f)
        for h in list(self.handlers):
            h(f, t)

    def frames_since(self, mark, pred=lambda f: True):
        return [f for f in self.log[mark:] if pred(f)]

    def close(self):
        self.running = False
        self.thread.join()
        self.sock.close()


class Direction:
    """A data direction the tester sends (W§3.2): random conn_id and token, per-path sequences."""

    def __init__(self, port, src_ip, path_count=4, sport_base=None):
        self.port, self.src_ip = port, src_ip
        self.conn_id = random.randrange(1, 2**32)
        self.token = random.randrange(1, 2**64)
        self.path_count = path_count
        self.next_seq = [0] * path_count
        base = sport_base or random.randrange(49152, 65536 - path_count)
        self.sport = [base + p for p in range(path_count)]
        self.t0 = time.monotonic_ns()

    def header(self, path, seq=None, **kw):
        if seq is None:
            seq = self.next_seq[path]
            self.next_seq[path] += 1
        m = w.Mrh(conn_id=self.conn_id, token=self.token, path_id=path,
                  path_count=self.path_count, path_seq=seq,
                  timestamp=(time.monotonic_ns() - self.t0) & 0xffffffff, ack_floor=0)
        m.__dict__.update(kw)
        return m

    def send(self, m, **ip_kw):
        self.port.send_mrh(self.src_ip, self.sport[m.path_id % self.path_count], m, **ip_kw)
        return m

    def acks(self, mark, path=None):
        """ACKs of this direction the IUT sent since log index mark."""
        return self.port.frames_since(mark, lambda f: f.mrh.opcode == w.ACK and
                                      f.mrh.conn_id == self.conn_id and f.src_ip == self.port.iut_ip
                                      and f.dst_ip == self.src_ip and
                                      (path is None or f.mrh.path_id == path))


class Agent:
    """The IUT's agent (agent.py) as a subprocess speaking JSON lines."""

    def __init__(self, argv, log_path):
        self.log = open(log_path, "w")
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.log, text=True, bufsize=1)
        first = self.p.stdout.readline()
        if not first:
            self.p.wait()
            raise Skip(f"the agent did not start ({' '.join(argv)}); see {log_path}")

    def __call__(self, cmd, **kw):
        kw["cmd"] = cmd
        self.p.stdin.write(json.dumps(kw) + "\n")
        line = self.p.stdout.readline()
        if not line:
            raise Fail(f"the agent exited during {cmd}")
        r = json.loads(line)
        if not r.pop("ok"):
            raise Fail(f"agent: {r['error']}")
        return r

    def close(self):
        try:
            self.p.stdin.close()
            self.p.wait(5)
        except Exception:
            self.p.kill()
        self.log.close()


class Counters:
    """The IUT's counters through an adapter command printing JSON {"counters": {...}}."""

    def __init__(self, cmd):
        self.cmd = cmd

    def available(self):
        return bool(self.cmd)

    def read(self):
        out = subprocess.run(self.cmd, shell=True, check=True, capture_output=True, text=True).stdout
        return json.loads(out)["counters"]


def pattern(n, seed):
    """n bytes of a pattern that differs per seed and per offset."""
    r = random.Random(seed)
    return bytes(r.randrange(256) for _ in range(n))
