-- SPDX-License-Identifier: Apache-2.0
-- Wireshark/tshark dissector for the MetaRoCE wire format (docs/spec/wire.md, version 1) and its
-- link goodbye frames (docs/spec/link.md §4). Every field of every header is decoded; values a
-- receiver would drop get an expert note with the spec's reason.
--   tshark -X lua_script:metaroce.lua -r capture.pcap -V
-- or copy it to ~/.local/lib/wireshark/plugins/. The UDP port (default 4793) is a preference.

local mr = Proto("metaroce", "MetaRoCE")

local opcodes = {
  [1] = "WRITE", [2] = "WRITE_IMM", [3] = "SEND", [4] = "SEND_IMM", [5] = "READ_REQ",
  [6] = "READ_RESP", [7] = "ATOMIC_CMP_SWP", [8] = "ATOMIC_FETCH_ADD", [9] = "SEND_INV",
  [12] = "ATOMIC_WRITE", [16] = "ACK", [17] = "PROBE",
}
local syndromes = {
  [1] = "RNR", [2] = "remote access", [3] = "remote bounds", [4] = "remote invalid",
  [5] = "remote operation", [7] = "unreachable",
}

local f = {
  -- base header (wire.md §2.1)
  version = ProtoField.uint8("metaroce.version", "Version", base.DEC),
  opcode = ProtoField.uint8("metaroce.opcode", "Opcode", base.DEC, opcodes),
  flags = ProtoField.uint16("metaroce.flags", "Flags", base.HEX),
  failover = ProtoField.bool("metaroce.flags.failover", "Failover copy", 16, nil, 0x8000),
  redundant = ProtoField.bool("metaroce.flags.redundant", "Redundant copy (original in flight)", 16, nil, 0x4000),
  more = ProtoField.bool("metaroce.flags.more", "Sender has more queued", 16, nil, 0x2000),
  noecho = ProtoField.bool("metaroce.flags.noecho", "ACK: echo dates nothing", 16, nil, 0x1000),
  xrc = ProtoField.bool("metaroce.flags.xrc", "XRC extension follows", 16, nil, 0x0800),
  orig_path = ProtoField.uint16("metaroce.flags.orig_path", "Original path", base.DEC, nil, 0x00ff),
  conn_id = ProtoField.uint32("metaroce.conn_id", "Connection id", base.HEX),
  token = ProtoField.uint64("metaroce.token", "Token", base.HEX),
  path_id = ProtoField.uint16("metaroce.path_id", "Path", base.DEC),
  path_count = ProtoField.uint16("metaroce.path_count", "Path count", base.DEC),
  path_seq = ProtoField.uint32("metaroce.path_seq", "Path sequence", base.DEC),
  timestamp = ProtoField.uint32("metaroce.timestamp", "Timestamp (ns, low 32 bits)", base.DEC),
  ack_floor = ProtoField.uint32("metaroce.ack_floor", "Ack floor", base.DEC),
  -- data extension (§2.2)
  dst_stream = ProtoField.uint32("metaroce.dst_stream", "Destination stream (QP)", base.HEX),
  src_stream = ProtoField.uint32("metaroce.src_stream", "Source stream (QP)", base.HEX),
  msn = ProtoField.uint32("metaroce.msn", "Message sequence number", base.DEC),
  rsn = ProtoField.uint32("metaroce.rsn", "Receive sequence number", base.DEC),
  offset = ProtoField.uint32("metaroce.offset", "Offset", base.DEC),
  total_length = ProtoField.uint32("metaroce.total_length", "Total length", base.DEC),
  remote_addr = ProtoField.uint64("metaroce.remote_addr", "Remote address", base.HEX),
  rkey = ProtoField.uint32("metaroce.rkey", "Rkey", base.HEX),
  imm = ProtoField.uint32("metaroce.imm", "Immediate data", base.HEX),
  payload_len = ProtoField.uint32("metaroce.payload_len", "Payload length", base.DEC),
  orig_seq = ProtoField.uint32("metaroce.orig_seq", "Original sequence", base.DEC),
  xrc_srqn = ProtoField.uint32("metaroce.xrc_srqn", "XRC SRQ number", base.HEX),
  payload = ProtoField.bytes("metaroce.payload", "Payload"),
  -- ACK extension (§2.3)
  cum_seq = ProtoField.uint32("metaroce.ack.cum_seq", "Cumulative sequence", base.DEC),
  sack = ProtoField.bytes("metaroce.ack.sack", "SACK bitmap"),
  sack_word = ProtoField.uint64("metaroce.ack.sack_word", "SACK word", base.HEX),
  sack_received = ProtoField.uint16("metaroce.ack.sack_received", "Sequences above cum_seq received", base.DEC),
  echo_timestamp = ProtoField.uint32("metaroce.ack.echo_timestamp", "Echoed timestamp", base.DEC),
  ecn_ce_count = ProtoField.uint16("metaroce.ack.ecn_ce_count", "CE count", base.DEC),
  nak_count = ProtoField.uint16("metaroce.ack.nak_count", "NAK records", base.DEC),
  rate_hint = ProtoField.uint32("metaroce.ack.rate_hint", "Rate hint (Mbit/s)", base.DEC),
  -- NAK record (§2.4)
  nak = ProtoField.none("metaroce.nak", "NAK record"),
  nak_seq = ProtoField.uint32("metaroce.nak.path_seq", "Rejected sequence", base.DEC),
  nak_src_stream = ProtoField.uint32("metaroce.nak.src_stream", "Source stream", base.HEX),
  nak_msn = ProtoField.uint32("metaroce.nak.msn", "Message sequence number", base.DEC),
  nak_syndrome = ProtoField.uint8("metaroce.nak.syndrome", "Syndrome", base.DEC, syndromes),
  nak_reserved = ProtoField.uint24("metaroce.nak.reserved", "Reserved", base.HEX),
}
local fields = {}
for _, v in pairs(f) do fields[#fields + 1] = v end
mr.fields = fields

local e_bad = ProtoExpert.new("metaroce.bad", "Field out of range (a receiver drops the packet)",
                              expert.group.MALFORMED, expert.severity.ERROR)
local e_len = ProtoExpert.new("metaroce.length", "Length does not match the header",
                              expert.group.MALFORMED, expert.severity.ERROR)
local e_failover = ProtoExpert.new("metaroce.failover_copy", "Failover copy of a packet of another path",
                                   expert.group.SEQUENCE, expert.severity.NOTE)
mr.experts = { e_bad, e_len, e_failover }

mr.prefs.port = Pref.uint("UDP port", 4793, "UDP destination port of MetaRoCE (wire.md §1)")

local BASE, DATA_END, ACK_END, NAK_LEN = 32, 80, 80, 16

-- xrc: the packet has the XRC extension (wire.md §2.2.1); the payload follows it.
local function dissect_data(tvb, tree, xrc)
  tree:add(f.dst_stream, tvb(32, 4))
  tree:add(f.src_stream, tvb(36, 4))
  tree:add(f.msn, tvb(40, 4))
  tree:add(f.rsn, tvb(44, 4))
  tree:add(f.offset, tvb(48, 4))
  tree:add(f.total_length, tvb(52, 4))
  tree:add(f.remote_addr, tvb(56, 8))
  tree:add(f.rkey, tvb(64, 4))
  tree:add(f.imm, tvb(68, 4))
  local plen = tree:add(f.payload_len, tvb(72, 4))
  tree:add(f.orig_seq, tvb(76, 4))
  local payload_at = DATA_END
  if xrc then
    if tvb:len() < DATA_END + 4 then
      tree:add_proto_expert_info(e_len)
      return ""
    end
    local x = tree:add(f.xrc_srqn, tvb(DATA_END, 4))
    if tvb(DATA_END, 1):uint() ~= 0 then x:add_proto_expert_info(e_bad) end
    payload_at = DATA_END + 4
  end
  local payload_len = tvb(72, 4):uint()
  if payload_len ~= tvb:reported_len() - payload_at then plen:add_proto_expert_info(e_len) end
  if tvb:len() > payload_at then tree:add(f.payload, tvb(payload_at)) end
  return string.format(" dst 0x%x msn %u off %u len %u", tvb(32, 4):uint(), tvb(40, 4):uint(),
                       tvb(48, 4):uint(), payload_len)
end

local function dissect_ack(tvb, tree)
  tree:add(f.cum_seq, tvb(32, 4))
  local s = tree:add(f.sack, tvb(36, 32))
  local received = 0
  for w = 0, 3 do
    local word = tvb(36 + 8 * w, 8):uint64()
    s:add(f.sack_word, tvb(36 + 8 * w, 8))
    for b = 0, 63 do
      if word:band(UInt64(1):lshift(b)) ~= UInt64(0) then received = received + 1 end
    end
  end
  s:add(f.sack_received, received):set_generated()
  tree:add(f.echo_timestamp, tvb(68, 4))
  tree:add(f.ecn_ce_count, tvb(72, 2))
  local nc = tree:add(f.nak_count, tvb(74, 2))
  tree:add(f.rate_hint, tvb(76, 4))
  local naks = tvb(74, 2):uint()
  if naks > 16 then nc:add_proto_expert_info(e_bad) end
  if tvb:reported_len() ~= ACK_END + NAK_LEN * naks then nc:add_proto_expert_info(e_len) end
  for i = 0, naks - 1 do
    local off = ACK_END + NAK_LEN * i
    if off + NAK_LEN > tvb:len() then break end
    local n = tree:add(f.nak, tvb(off, NAK_LEN))
    n:add(f.nak_seq, tvb(off, 4))
    n:add(f.nak_src_stream, tvb(off + 4, 4))
    n:add(f.nak_msn, tvb(off + 8, 4))
    local syn = n:add(f.nak_syndrome, tvb(off + 12, 1))
    n:add(f.nak_reserved, tvb(off + 13, 3))
    local code = tvb(off + 12, 1):uint()
    n:append_text(string.format(": seq %u %s", tvb(off, 4):uint(), syndromes[code] or "?"))
    if not syndromes[code] then syn:add_proto_expert_info(e_bad) end
  end
  return string.format(" cum %u sacked %u ce %u naks %u hint %u", tvb(32, 4):uint(), received,
                       tvb(72, 2):uint(), naks, tvb(76, 4):uint())
end

function mr.dissector(tvb, pinfo, root)
  if tvb:len() < BASE then return 0 end
  pinfo.cols.protocol = "MetaRoCE"
  local tree = root:add(mr, tvb())
  tree:add(f.version, tvb(0, 1))
  local op = tvb(1, 1):uint()
  local opitem = tree:add(f.opcode, tvb(1, 1))
  local fl = tree:add(f.flags, tvb(2, 2))
  fl:add(f.failover, tvb(2, 2))
  fl:add(f.redundant, tvb(2, 2))
  fl:add(f.more, tvb(2, 2))
  fl:add(f.noecho, tvb(2, 2))
  fl:add(f.xrc, tvb(2, 2))
  fl:add(f.orig_path, tvb(2, 2))
  tree:add(f.conn_id, tvb(4, 4))
  tree:add(f.token, tvb(8, 8))
  tree:add(f.path_id, tvb(16, 2))
  tree:add(f.path_count, tvb(18, 2))
  tree:add(f.path_seq, tvb(20, 4))
  tree:add(f.timestamp, tvb(24, 4))
  tree:add(f.ack_floor, tvb(28, 4))
  local flags = tvb(2, 2):uint()
  local name = opcodes[op]
  local info = string.format("%s conn 0x%08x path %u/%u seq %u", name or ("opcode " .. op),
                             tvb(4, 4):uint(), tvb(16, 2):uint(), tvb(18, 2):uint(), tvb(20, 4):uint())
  if flags >= 0x8000 then
    fl:add_proto_expert_info(e_failover)
    local what = bit.band(flags, 0x4000) ~= 0 and "redundant-copy" or "failover-copy"
    info = info .. string.format(" %s of path %u", what, bit.band(flags, 0xff))
  end
  if not name then
    opitem:add_proto_expert_info(e_bad)
  elseif op <= 9 or op == 12 then
    local xrc = op ~= 6 and bit.band(flags, 0x0800) ~= 0
    if tvb:len() < DATA_END then tree:add_proto_expert_info(e_len) else info = info .. dissect_data(tvb, tree, xrc) end
  elseif op == 16 then
    if tvb:len() < ACK_END then tree:add_proto_expert_info(e_len) else info = info .. dissect_ack(tvb, tree) end
  elseif op == 17 and tvb:reported_len() ~= BASE then
    tree:add_proto_expert_info(e_len)
  end
  pinfo.cols.info = info
  return tvb:len()
end

-- Link goodbye (link.md §4): EtherType 0x88B5, kind 1 goodbye, 2 acknowledged.
local gb = Proto("metaroce_link", "MetaRoCE link goodbye")
local gb_kind = ProtoField.uint8("metaroce_link.kind", "Kind", base.DEC, { [1] = "goodbye", [2] = "goodbye acknowledged" })
gb.fields = { gb_kind }
function gb.dissector(tvb, pinfo, root)
  if tvb:len() < 1 then return 0 end
  pinfo.cols.protocol = "MetaRoCE link"
  local t = root:add(gb, tvb())
  t:add(gb_kind, tvb(0, 1))
  pinfo.cols.info = tvb(0, 1):uint() == 1 and "goodbye" or "goodbye acknowledged"
  return tvb:len()
end

local registered_port = nil
local function register_port()
  local udp = DissectorTable.get("udp.port")
  if registered_port then udp:remove(registered_port, mr) end
  registered_port = mr.prefs.port
  udp:add(registered_port, mr)
end
mr.prefs_changed = register_port
register_port()
DissectorTable.get("ethertype"):add(0x88b5, gb)
