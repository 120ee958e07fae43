#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The IUT's side of the compliance suite: plain libibverbs (pyverbs), driven by the tester.

Reads one JSON command per line on stdin, answers one JSON line on stdout. It uses nothing but
standard verbs (and librdmacm for group joins), so it drives any RDMA device whose RC QPs take an
IPv4-mapped GID as their peer's address (compliance/README.md, "Adapter"). Commands (all answer
{"ok": true, ...} or {"ok": false, "error": ...}):

  {"cmd": "mr", "size": N, "fill": BYTE}              -> {"mr": id, "addr", "rkey", "lkey"}
  {"cmd": "qp", "ip": "198.18.x.y", "qpn": N, "min_rnr_timer", "timeout", "retry_cnt",
   "rnr_retry"}                                       -> {"qp": id, "qpn"}
  {"cmd": "post_recv", "qp", "mr", "offset", "len", "wr_id"}
  {"cmd": "post_send", "qp", "op": "write"|"send"|"read", "mr", "offset", "len", "wr_id",
   "raddr", "rkey"}
  {"cmd": "poll", "max": N, "wait_ms": T}             -> {"wcs": [{wr_id, status, opcode, len, qpn}]}
  {"cmd": "read", "mr", "offset", "len"}              -> {"hex": ...}
  {"cmd": "write", "mr", "offset", "hex"}             (local memory, not RDMA)
  {"cmd": "destroy_qp", "qp"}
  {"cmd": "device"}                                   -> {"max_mcast_grp", "max_mcast_qp_attach"}
  {"cmd": "ud_qp", "qkey": Q}                         -> {"qp": id, "qpn"}   (UD, in RTS)
  {"cmd": "ud_send", "qp", "group": "a.b.c.d", "mr", "offset", "len", "wr_id", "qkey",
   "imm": N or null}                                  (a SEND to the group's IPv4-mapped GID,
                                                       remote QPN 0xffffff)
  {"cmd": "join", "ip": "198.18.x.y", "group": "a.b.c.d", "recvs": N}
                                                      -> {"member": id, "qpn", "qkey"}
      a UD QP of the RDMA CM (librdmacm, as applications join) that joins the group from the
      device's address ip, with N receives of 2048 bytes posted
  {"cmd": "member_poll", "member", "max": N, "wait_ms": T}
                                                      -> {"wcs": [{status, opcode, len, imm,
                                                          src_qp, hex}]} (hex: what landed)
  {"cmd": "leave", "member"}                          (leaves the group, destroys the QP)
"""
import argparse
import json
import sys
import time

from pyverbs.addr import AH, AHAttr, GlobalRoute, GID
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import RecvWR, SendWR, SGE
import pyverbs.enums as e

OPS = {"write": e.IBV_WR_RDMA_WRITE, "send": e.IBV_WR_SEND, "read": e.IBV_WR_RDMA_READ}


def mapped_gid(ip):
    """The IPv4-mapped GID of an IPv4 address (RoCE v2)."""
    a, b, c, d = (int(x) for x in ip.split("."))
    return GID(f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}")


class Agent:
    def __init__(self, dev, port, gid_index):
        self.ctx = Context(name=dev)
        self.port, self.gid_index = port, gid_index
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 1024)
        self.mrs, self.qps = {}, {}
        self.ahs = []   # kept while their WQEs may be in flight
        self.members = {}   # group members made through the RDMA CM (join)

    def mr(self, size, fill=0):
        access = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE |
                  e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_ATOMIC)
        mr = MR(self.pd, size, access)
        mr.write(bytes([fill]) * size, size, 0)
        i = len(self.mrs) + 1
        self.mrs[i] = mr
        return {"mr": i, "addr": mr.buf, "rkey": mr.rkey, "lkey": mr.lkey}

    def qp(self, ip, qpn, min_rnr_timer=12, timeout=14, retry_cnt=7, rnr_retry=7):
        cap = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
        qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        attr = QPAttr(port_num=self.port)
        attr.path_mtu = e.IBV_MTU_1024
        attr.qp_access_flags = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE |
                                e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_ATOMIC)
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = min_rnr_timer
        attr.timeout = timeout
        attr.retry_cnt = retry_cnt
        attr.rnr_retry = rnr_retry
        attr.dest_qp_num = qpn
        attr.rq_psn = attr.sq_psn = 0
        gr = GlobalRoute(dgid=mapped_gid(ip), sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(port_num=self.port, is_global=1, gr=gr)
        qp.to_rts(attr)
        i = len(self.qps) + 1
        self.qps[i] = qp
        return {"qp": i, "qpn": qp.qp_num}

    def post_recv(self, qp, mr, offset, len, wr_id):
        m = self.mrs[mr]
        self.qps[qp].post_recv(RecvWR(wr_id=wr_id, num_sge=1,
                                      sg=[SGE(m.buf + offset, len, m.lkey)]))
        return {}

    def post_send(self, qp, op, mr, offset, len, wr_id, raddr=0, rkey=0):
        m = self.mrs[mr]
        wr = SendWR(wr_id=wr_id, opcode=OPS[op], num_sge=1,
                    sg=[SGE(m.buf + offset, len, m.lkey)], send_flags=e.IBV_SEND_SIGNALED)
        if op in ("write", "read"):
            wr.set_wr_rdma(rkey, raddr)
        self.qps[qp].post_send(wr)
        return {}

    def poll(self, max=16, wait_ms=0):
        out, end = [], time.monotonic() + wait_ms / 1000
        while True:
            n, wcs = self.cq.poll(max - len(out))
            for wc in wcs[:n]:
                out.append({"wr_id": wc.wr_id, "status": wc.status, "opcode": wc.opcode,
                            "len": wc.byte_len, "qpn": wc.qp_num})
            if len(out) >= max or time.monotonic() >= end:
                return {"wcs": out}
            time.sleep(0.002)  # light: the tester's ACKs share these cores

    def read(self, mr, offset, len):
        return {"hex": self.mrs[mr].read(len, offset).hex()}

    def write(self, mr, offset, hex):
        data = bytes.fromhex(hex)
        self.mrs[mr].write(data, len(data), offset)
        return {}

    def device(self):
        a = self.ctx.query_device()
        return {"max_mcast_grp": a.max_mcast_grp, "max_mcast_qp_attach": a.max_mcast_qp_attach}

    def ud_qp(self, qkey):
        cap = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
        qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_UD, scq=self.cq, rcq=self.cq, cap=cap))
        attr = QPAttr(port_num=self.port)
        attr.qkey = qkey
        attr.pkey_index = 0
        attr.sq_psn = 0
        qp.to_rts(attr)
        i = len(self.qps) + 1
        self.qps[i] = qp
        return {"qp": i, "qpn": qp.qp_num}

    def ud_send(self, qp, group, mr, offset, len, wr_id, qkey, imm=None):
        m = self.mrs[mr]
        gr = GlobalRoute(dgid=mapped_gid(group), sgid_index=self.gid_index)
        ah = AH(self.pd, attr=AHAttr(port_num=self.port, is_global=1, gr=gr))
        self.ahs.append(ah)
        op = e.IBV_WR_SEND if imm is None else e.IBV_WR_SEND_WITH_IMM
        wr = SendWR(wr_id=wr_id, opcode=op, num_sge=1, sg=[SGE(m.buf + offset, len, m.lkey)],
                    send_flags=e.IBV_SEND_SIGNALED)
        if imm is not None:
            wr.imm_data = imm
        wr.set_wr_ud(ah, 0xffffff, qkey)
        self.qps[qp].post_send(wr)
        return {}

    def destroy_qp(self, qp):
        self.qps.pop(qp).close()
        return {}

    def join(self, ip, group, recvs):
        from pyverbs.cmid import AddrInfo, CMEvent, CMEventChannel, CMID
        import pyverbs.cm_enums as ce
        ch = CMEventChannel()
        cmid = CMID(creator=ch, port_space=ce.RDMA_PS_UDP)

        def event(want):
            ev = CMEvent(ch)
            got = ev.event_type
            ev.ack_cm_event()
            if got != want:
                raise RuntimeError(f"RDMA CM event {got}, expected {want}")
        # As mckey joins: bound to the device's address (which gives pyverbs the device's
        # context and PD), the group resolved, a UD QP, the join.
        cmid.bind_addr(AddrInfo(src=ip, port_space=ce.RDMA_PS_UDP, flags=ce.RAI_PASSIVE))
        cmid.resolve_addr(AddrInfo(src=ip, dst=group, port_space=ce.RDMA_PS_UDP), 2000)
        event(ce.RDMA_CM_EVENT_ADDR_RESOLVED)
        cq = CQ(cmid.context, 64)   # ours, polled without blocking (member_poll)
        m = {"ch": ch, "cmid": cmid, "cq": cq, "group": group, "mrs": [], "next": 0}
        cap = QPCap(max_send_wr=1, max_recv_wr=max(recvs, 1), max_send_sge=1, max_recv_sge=1)
        cmid.create_qp(QPInitAttr(qp_type=e.IBV_QPT_UD, scq=cq, rcq=cq, cap=cap))
        # Receives first, each in a region of its own (rdma_post_recv fills a region from its
        # start): UD receives complete in the order posted, so the n-th completion is region n.
        for _ in range(recvs):
            m["mrs"].append(cmid.reg_msgs(2048))
            cmid.post_recv(m["mrs"][-1])
        cmid.join_multicast(addr=AddrInfo(src=group))
        event(ce.RDMA_CM_EVENT_MULTICAST_JOIN)
        qkey = cmid.query_qp(e.IBV_QP_QKEY)[0].qkey
        i = len(self.members) + 1
        self.members[i] = m
        return {"member": i, "qpn": cmid.qpn, "qkey": qkey}

    def member_poll(self, member, max=16, wait_ms=0):
        m = self.members[member]
        out, end = [], time.monotonic() + wait_ms / 1000
        while len(out) < max:
            n, wcs = m["cq"].poll(max - len(out))
            for c in wcs[:n]:
                mr = m["mrs"][m["next"]]
                m["next"] += 1
                out.append({"status": c.status, "opcode": c.opcode, "len": c.byte_len,
                            "imm": c.imm_data if c.wc_flags & e.IBV_WC_WITH_IMM else None,
                            "src_qp": c.src_qp,
                            "hex": mr.read(min(c.byte_len, 2048), 0).hex() if c.status == 0
                            else ""})
            if n == 0 and time.monotonic() >= end:
                break
            if n == 0:
                time.sleep(0.001)
        return {"wcs": out}

    def leave(self, member):
        from pyverbs.cmid import AddrInfo
        m = self.members.pop(member)
        m["cmid"].leave_multicast(AddrInfo(src=m["group"]))
        for mr in m["mrs"]:
            mr.close()
        m["cmid"].close()
        m["cq"].close()
        m["ch"].close()
        return {}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dev", required=True, help="verbs device name")
    ap.add_argument("--port", type=int, default=1)
    ap.add_argument("--gid-index", type=int, default=0)
    a = ap.parse_args()
    agent = Agent(a.dev, a.port, a.gid_index)
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req.pop("cmd")
        try:
            res = getattr(agent, cmd)(**req)
            res["ok"] = True
        except Exception as ex:  # reported to the tester, which fails the check
            res = {"ok": False, "error": f"{cmd}: {type(ex).__name__}: {ex}"}
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
