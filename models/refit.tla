------------------------------- MODULE refit -------------------------------
(***************************************************************************)
(* The recoverable refit protocol of dcr (NeMo-DCR paper §6.3, §7.2,       *)
(* App. B, Algorithms B.1 and B.2): one transition v -> v+1 with overwrite *)
(* retries, a joint compare-and-set commit, coordinator takeover, operator *)
(* abort and receivers that rejoin by dense refit.                         *)
(*                                                                         *)
(* This module is the readable contract.  dcr/testing/spec/ mirrors it in  *)
(* Python (one function per action, same names in snake case) and checks   *)
(* it exhaustively; tests/model/ keeps the names, the edge table and the   *)
(* invariants of the two in step.                                          *)
(*                                                                         *)
(* Abstractions.  Each owner sends one payload per attempt, covering one   *)
(* range of every receiver's storage.  A range holds the bits of v (V0),   *)
(* of v+1 (V1), BAD when an XOR entry landed on bits other than its base,  *)
(* or LOST after a crash.  Control calls reach every live endpoint of the  *)
(* attempt in one step (the engine retries them; they are idempotent).     *)
(* Payloads travel one by one and may be lost, duplicated, reordered or    *)
(* arrive after their attempt is obsolete.                                 *)
(*                                                                         *)
(* What happens between transitions -- joining, restarted and restored     *)
(* receivers, dense-refit jobs, takeovers over a run of several            *)
(* transitions -- is membership.tla, which abstracts one transition.       *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets, TLC

CONSTANTS
    NumOwners, NumReceivers, MaxAttempts,
    Failovers,      \* coordinators beyond the first that may take over
    Failures,       \* attempt failures the environment may cause
    Losses, Duplicates, Crashes, ReplyLosses, Aborts,
    Sync,           \* TRUE: synchronous RL; FALSE: asynchronous RL (staging)
    ReplacedActs,   \* TRUE: a replaced coordinator runs on until told
    AtomicDelivery  \* TRUE: a payload reaches every live receiver at once

Owners == 0 .. (NumOwners - 1)
Receivers == 0 .. (NumReceivers - 1)
Coords == 1 .. (Failovers + 1)
NONE == 0
V0 == 0
V1 == 1
BAD == 2
LOST == 3
EMPTY == -1
XOR_V0 == "xor_v0"       \* mask computed against baseline v
XOR_V1 == "xor_v1"       \* mask computed against baseline v+1 (never sent)
OVERWRITE == "overwrite"

VARIABLES
    record,       \* NONE while the commit record holds K^v, else the attempt it names
    commitEpoch,  \* active coordinator epoch when the record changed
    epoch,        \* the active coordinator
    registered,   \* last attempt the control plane registered
    coord,        \* coordinator -> [started, tphase, aphase, attempt, overwrite,
                  \*                 admitted, reported, stopped]
    attempts,     \* attempt id -> [coord, overwrite, required, acks, obsolete,
                  \*                cas, reply, expired]
    owner,        \* owner -> [phase, attempt, baseline, sent]
    rx,           \* receiver -> [phase, attempt, inc, gateOpen, kv, storage,
                  \*              staged, applied, held, epoch, acked]
    inflight,     \* payloads in flight: [attempt, range, receiver, enc]
    budget        \* faults the environment may still inject

vars == <<record, commitEpoch, epoch, registered, coord, attempts, owner, rx,
          inflight, budget>>

(***************************************************************************)
(* The lifecycle tables: generated from dcr/protocol/lifecycle.py (EDGES)  *)
(* by scripts/gen_protocol_doc.py; a test fails when they drift.           *)
(***************************************************************************)
\* BEGIN GENERATED EDGES
TransitionEdges == {
    <<"idle", "prepare", "admitting">>,
    <<"idle", "take_over", "taking_over">>,
    <<"admitting", "send", "running">>,
    <<"admitting", "reject", "rejecting">>,
    <<"admitting", "fail", "readmitting">>,
    <<"readmitting", "prepare", "admitting">>,
    <<"running", "fail", "recovering">>,
    <<"running", "commit_failed", "recovering">>,
    <<"running", "commit_succeeded", "finishing">>,
    <<"recovering", "prepare", "running">>,
    <<"taking_over", "read_commit", "resolving">>,
    <<"resolving", "commit_succeeded", "finishing">>,
    <<"resolving", "commit_failed", "recovering">>,
    <<"finishing", "baseline_update", "finishing">>,
    <<"finishing", "cleanup", "reopening">>,
    <<"reopening", "reopen_gate", "committed">>,
    <<"rejecting", "cleanup", "rejected">>,
    <<"admitting", "abort", "aborting">>,
    <<"readmitting", "abort", "aborting">>,
    <<"running", "abort", "aborting">>,
    <<"recovering", "abort", "aborting">>,
    <<"aborting", "cleanup", "refitting">>,
    <<"refitting", "dense_refit", "refitting">>,
    <<"refitting", "reopen_gate", "aborted">>,
    <<"admitting", "conflict", "stood_down">>,
    <<"readmitting", "conflict", "stood_down">>,
    <<"running", "conflict", "stood_down">>,
    <<"recovering", "conflict", "stood_down">>,
    <<"taking_over", "conflict", "stood_down">>,
    <<"resolving", "conflict", "stood_down">>,
    <<"finishing", "conflict", "stood_down">>,
    <<"reopening", "conflict", "stood_down">>,
    <<"rejecting", "conflict", "stood_down">>,
    <<"aborting", "conflict", "stood_down">>,
    <<"refitting", "conflict", "stood_down">>
}

AttemptEdges == {
    <<"planned", "prepare", "preparing">>,
    <<"planned", "take_over", "failed">>,
    <<"preparing", "send", "streaming">>,
    <<"preparing", "reject", "failed">>,
    <<"streaming", "wait_for_requests", "gating">>,
    <<"gating", "open_apply", "applying">>,
    <<"applying", "flush", "flushing">>,
    <<"flushing", "commit", "committing">>,
    <<"committing", "commit_succeeded", "committed">>,
    <<"committing", "commit_failed", "failed">>,
    <<"committing", "commit_unknown", "unknown">>,
    <<"unknown", "read_commit", "resolving">>,
    <<"resolving", "commit_succeeded", "committed">>,
    <<"resolving", "commit_failed", "failed">>,
    <<"preparing", "fail", "failed">>,
    <<"streaming", "fail", "failed">>,
    <<"gating", "fail", "failed">>,
    <<"applying", "fail", "failed">>,
    <<"flushing", "fail", "failed">>,
    <<"failed", "mark_obsolete", "obsolete">>,
    <<"obsolete", "stop_and_wait", "stopping">>,
    <<"stopping", "cleanup", "cleaned">>,
    <<"committed", "cleanup", "cleaned">>,
    <<"preparing", "conflict", "abandoned">>,
    <<"streaming", "conflict", "abandoned">>,
    <<"gating", "conflict", "abandoned">>,
    <<"applying", "conflict", "abandoned">>,
    <<"flushing", "conflict", "abandoned">>,
    <<"committing", "conflict", "abandoned">>,
    <<"unknown", "conflict", "abandoned">>,
    <<"resolving", "conflict", "abandoned">>,
    <<"committed", "conflict", "abandoned">>,
    <<"failed", "conflict", "abandoned">>,
    <<"obsolete", "conflict", "abandoned">>,
    <<"stopping", "conflict", "abandoned">>
}

OwnerEdges == {
    <<"idle", "prepare", "prepared">>,
    <<"prepared", "send", "sending">>,
    <<"sending", "send", "sending">>,
    <<"sending", "flush", "sent">>,
    <<"prepared", "mark_obsolete", "obsolete">>,
    <<"sending", "mark_obsolete", "obsolete">>,
    <<"sent", "mark_obsolete", "obsolete">>,
    <<"obsolete", "stop_and_wait", "stopped">>,
    <<"stopped", "cleanup", "idle">>,
    <<"idle", "baseline_update", "updated">>,
    <<"sent", "baseline_update", "updated">>,
    <<"obsolete", "baseline_update", "updated">>,
    <<"stopped", "baseline_update", "updated">>,
    <<"updated", "baseline_update", "updated">>,
    <<"updated", "cleanup", "idle">>
}

ReceiverEdges == {
    <<"joining", "dense_refit", "refitted">>,
    <<"ready", "dense_refit", "refitted">>,
    <<"refitted", "dense_refit", "refitted">>,
    <<"cleaned", "dense_refit", "refitted">>,
    <<"ready", "prepare", "prepared">>,
    <<"refitted", "prepare", "prepared">>,
    <<"cleaned", "prepare", "prepared">>,
    <<"prepared", "ingest", "prepared">>,
    <<"gated", "ingest", "gated">>,
    <<"applying", "ingest", "applying">>,
    <<"flushing", "ingest", "flushing">>,
    <<"prepared", "wait_for_requests", "gated">>,
    <<"gated", "open_apply", "applying">>,
    <<"applying", "apply", "applying">>,
    <<"flushing", "apply", "flushing">>,
    <<"applying", "flush", "flushing">>,
    <<"flushing", "ack", "acked">>,
    <<"prepared", "fail", "failed">>,
    <<"gated", "fail", "failed">>,
    <<"applying", "fail", "failed">>,
    <<"flushing", "fail", "failed">>,
    <<"prepared", "mark_obsolete", "obsolete">>,
    <<"gated", "mark_obsolete", "obsolete">>,
    <<"applying", "mark_obsolete", "obsolete">>,
    <<"flushing", "mark_obsolete", "obsolete">>,
    <<"acked", "mark_obsolete", "obsolete">>,
    <<"failed", "mark_obsolete", "obsolete">>,
    <<"obsolete", "stop_and_wait", "stopped">>,
    <<"stopped", "cleanup", "cleaned">>,
    <<"acked", "cleanup", "cleaned">>,
    <<"cleaned", "reopen_gate", "ready">>,
    <<"refitted", "reopen_gate", "ready">>
}
\* END GENERATED EDGES

Go(edges, p, t) == (CHOOSE e \in edges : e[1] = p /\ e[2] = t)[3]
Can(edges, p, t) == \E e \in edges : e[1] = p /\ e[2] = t

NumAttempts == Cardinality(DOMAIN attempts)
Att(t) == attempts[t]
RecordVersion == IF record = NONE THEN V0 ELSE V1
Live(t) == {q[1] : q \in {q2 \in Att(t).required : rx[q2[1]].inc = q2[2]}}
Acting == {c \in Coords : coord[c].started /\ (ReplacedActs \/ c = epoch)}
AttemptRunning == {"preparing", "streaming", "gating", "applying", "flushing"}
ReceiverRunning == {"prepared", "gated", "applying", "flushing"}
TransitionTerminal == {"committed", "rejected", "aborted", "stood_down"}
Enc(t, o) == IF Att(t).overwrite THEN OVERWRITE
             ELSE IF owner[o].baseline = V0 THEN XOR_V0 ELSE XOR_V1
ApplyEntry(v, enc) == IF enc = OVERWRITE THEN V1
                      ELSE IF enc = XOR_V0 /\ v = V0 THEN V1 ELSE BAD
Dirty(r) == \E x \in Owners : rx[r].storage[x] # rx[r].held   \* writes landed
AwaitsOutcome(t) == \E c \in Coords : coord[c].started /\ coord[c].attempt = t
                                      /\ coord[c].aphase \in {"committing", "unknown"}

Init ==
    /\ record = NONE /\ commitEpoch = NONE /\ epoch = 1 /\ registered = NONE
    /\ coord = [c \in Coords |-> [started |-> c = 1, tphase |-> "idle",
                                  aphase |-> "planned", attempt |-> NONE,
                                  overwrite |-> FALSE, admitted |-> FALSE,
                                  reported |-> {}, stopped |-> FALSE]]
    /\ attempts = <<>>
    /\ owner = [o \in Owners |-> [phase |-> "idle", attempt |-> NONE,
                                  baseline |-> V0, sent |-> FALSE]]
    /\ rx = [r \in Receivers |-> [phase |-> "ready", attempt |-> NONE, inc |-> 0,
                                  gateOpen |-> TRUE, kv |-> V0,
                                  storage |-> [x \in Owners |-> V0],
                                  staged |-> {}, applied |-> {}, held |-> V0,
                                  epoch |-> 0, acked |-> NONE]]
    /\ inflight = {}
    /\ budget = [losses |-> Losses, duplicates |-> Duplicates, crashes |-> Crashes,
                 failovers |-> Failovers, replyLosses |-> ReplyLosses,
                 failures |-> Failures, aborts |-> Aborts]

(***************************************************************************)
(* Admission and streaming (Algorithm B.1)                                 *)
(***************************************************************************)

\* Start an attempt; the control plane accepts it only from the active
\* coordinator and only while the record still holds K^v.
Prepare(c) ==
    LET cv == coord[c]
        t == NumAttempts + 1
        eligible == {r \in Receivers :
                        rx[r].epoch <= c
                        /\ (rx[r].phase \in {"ready", "cleaned"}
                            \/ (rx[r].phase = "refitted" /\ rx[r].held = RecordVersion))}
    IN
    /\ cv.tphase \in {"idle", "readmitting", "recovering"} /\ epoch = c
    /\ cv.attempt = NONE \/ cv.aphase = "cleaned"
    /\ NumAttempts < MaxAttempts /\ record = NONE
    /\ \A o \in Owners : owner[o].phase = "idle"
    /\ eligible # {}
    /\ attempts' = Append(attempts,
            [coord |-> c, overwrite |-> cv.overwrite,
             required |-> {<<r, rx[r].inc>> : r \in eligible}, acks |-> {},
             obsolete |-> FALSE, cas |-> "none", reply |-> "none", expired |-> FALSE])
    /\ coord' = [coord EXCEPT ![c].tphase = Go(TransitionEdges, cv.tphase, "prepare"),
                              ![c].aphase = Go(AttemptEdges, "planned", "prepare"),
                              ![c].attempt = t, ![c].stopped = FALSE]
    /\ owner' = [o \in Owners |-> [owner[o] EXCEPT
                    !.phase = Go(OwnerEdges, owner[o].phase, "prepare"),
                    !.attempt = t, !.sent = FALSE]]
    /\ rx' = [r \in Receivers |-> IF r \in eligible
                 THEN [rx[r] EXCEPT !.phase = Go(ReceiverEdges, rx[r].phase, "prepare"),
                                    !.attempt = t, !.staged = {}, !.applied = {},
                                    !.epoch = c]
                 ELSE rx[r]]
    /\ registered' = t
    /\ UNCHANGED <<record, commitEpoch, epoch, inflight, budget>>

\* A prepare check fails before admission: the transition ends with v.
Reject(c) ==
    /\ coord[c].aphase = "preparing" /\ coord[c].tphase = "admitting"
    /\ coord' = [coord EXCEPT ![c].aphase = Go(AttemptEdges, @, "reject"),
                              ![c].tphase = Go(TransitionEdges, @, "reject")]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, owner, rx,
                   inflight, budget>>

Stage(r, p) ==   \* the receiver keeps p if it is its active attempt's and new
    IF /\ rx[r].attempt = p.attempt /\ rx[r].phase \in ReceiverRunning
       /\ p.range \notin ({s[1] : s \in rx[r].staged} \cup rx[r].applied)
    THEN [rx[r] EXCEPT !.phase = Go(ReceiverEdges, @, "ingest"),
                       !.staged = @ \cup {<<p.range, p.enc>>}]
    ELSE rx[r]

\* The coordinator starts the owners (admission); an owner sends its payload.
SendStart(c) ==
    /\ coord[c].aphase = "preparing"
    /\ coord' = [coord EXCEPT
          ![c].aphase = Go(AttemptEdges, @, "send"),
          ![c].tphase = IF @ = "admitting" THEN Go(TransitionEdges, @, "send") ELSE @,
          ![c].admitted = IF coord[c].tphase = "admitting" THEN TRUE ELSE @]
    /\ owner' = [o \in Owners |->
          IF owner[o].attempt = coord[c].attempt /\ owner[o].phase = "prepared"
          THEN [owner[o] EXCEPT !.phase = Go(OwnerEdges, @, "send")] ELSE owner[o]]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, rx, inflight, budget>>

SendPayload(o) ==
    LET t == owner[o].attempt
        sent == {[attempt |-> t, range |-> o, receiver |-> r, enc |-> Enc(t, o)] :
                    r \in Live(t)}
    IN
    /\ owner[o].phase = "sending" /\ ~owner[o].sent
    /\ owner' = [owner EXCEPT ![o].phase = Go(OwnerEdges, @, "send"), ![o].sent = TRUE]
    /\ IF AtomicDelivery
       THEN /\ rx' = [r \in Receivers |->
                        IF r \in Live(t) THEN Stage(r, [attempt |-> t, range |-> o,
                                                        receiver |-> r, enc |-> Enc(t, o)])
                        ELSE rx[r]]
            /\ UNCHANGED inflight
       ELSE /\ inflight' = inflight \cup sent
            /\ UNCHANGED rx
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, coord, attempts, budget>>

Send(kind, p) == \/ (kind = "coordinator" /\ SendStart(p))
                 \/ (kind = "owner" /\ SendPayload(p))

\* A payload is delivered; the receiver drops other attempts' payloads and
\* duplicates (deduplication by attempt, owner and payload id).
Ingest(m) ==
    /\ m \in inflight
    /\ inflight' = inflight \ {m}
    /\ rx' = [rx EXCEPT ![m.receiver] = Stage(m.receiver, m)]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, coord, attempts, owner, budget>>

\* Close the request gate: at once in synchronous RL, after the arrival check
\* (every required receiver holds every payload) in asynchronous RL.
WaitForRequests(c) ==
    LET t == coord[c].attempt IN
    /\ coord[c].aphase = "streaming"
    /\ Sync \/ (/\ \A o \in Owners : owner[o].attempt = t /\ owner[o].sent
                /\ \A q \in Att(t).required :
                     rx[q[1]].attempt = t /\ {s[1] : s \in rx[q[1]].staged} = Owners)
    /\ coord' = [coord EXCEPT ![c].aphase = Go(AttemptEdges, @, "wait_for_requests")]
    /\ rx' = [r \in Receivers |->
          IF r \in Live(t) /\ rx[r].attempt = t /\ rx[r].phase = "prepared" /\ rx[r].epoch <= c
          THEN [rx[r] EXCEPT !.phase = Go(ReceiverEdges, @, "wait_for_requests"),
                             !.gateOpen = FALSE]
          ELSE rx[r]]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, owner, inflight, budget>>

\* Every required receiver closed its gate; receivers may apply.
OpenApply(c) ==
    LET t == coord[c].attempt IN
    /\ coord[c].aphase = "gating"
    /\ \A q \in Att(t).required :
          rx[q[1]].inc = q[2] /\ ~rx[q[1]].gateOpen /\ rx[q[1]].epoch <= c
    /\ coord' = [coord EXCEPT ![c].aphase = Go(AttemptEdges, @, "open_apply")]
    /\ rx' = [r \in Receivers |->
          IF r \in Live(t) /\ rx[r].attempt = t /\ rx[r].phase = "gated"
          THEN [rx[r] EXCEPT !.phase = Go(ReceiverEdges, @, "open_apply")] ELSE rx[r]]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, owner, inflight, budget>>

\* A receiver applies the next payload in declared order, never arrival order.
Apply(r) ==
    LET x == CHOOSE y \in Owners \ rx[r].applied :
                 \A z \in Owners \ rx[r].applied : y <= z
    IN
    /\ rx[r].phase \in {"applying", "flushing"} /\ rx[r].applied # Owners
    /\ \E s \in rx[r].staged :
          /\ s[1] = x
          /\ rx' = [rx EXCEPT ![r].phase = Go(ReceiverEdges, @, "apply"),
                              ![r].storage[x] = ApplyEntry(@, s[2]),
                              ![r].staged = @ \ {s},
                              ![r].applied = @ \cup {x}]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, coord, attempts, owner,
                   inflight, budget>>

\* Every owner sent its payload: close sends; receivers check arrival, drain.
Flush(c) ==
    LET t == coord[c].attempt IN
    /\ coord[c].aphase = "applying"
    /\ \A o \in Owners : owner[o].attempt = t /\ owner[o].phase = "sending" /\ owner[o].sent
    /\ coord' = [coord EXCEPT ![c].aphase = Go(AttemptEdges, @, "flush")]
    /\ owner' = [o \in Owners |-> [owner[o] EXCEPT !.phase = Go(OwnerEdges, @, "flush")]]
    /\ rx' = [r \in Receivers |->
          IF r \in Live(t) /\ rx[r].attempt = t /\ rx[r].phase = "applying"
          THEN [rx[r] EXCEPT !.phase = Go(ReceiverEdges, @, "flush")] ELSE rx[r]]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, inflight, budget>>

\* A receiver drained every declared payload: completion ACK.
Ack(r) ==
    LET t == rx[r].attempt IN
    /\ rx[r].phase = "flushing" /\ rx[r].applied = Owners
    /\ rx' = [rx EXCEPT ![r].phase = Go(ReceiverEdges, @, "ack"), ![r].acked = t]
    /\ attempts' = [attempts EXCEPT ![t].acks = @ \cup {<<r, rx[r].inc>>}]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, coord, owner, inflight, budget>>

(***************************************************************************)
(* Commit (Algorithm B.2)                                                  *)
(***************************************************************************)

\* Compare-and-set K^v -> (v+1, g), only once every required receiver ACKed.
Commit(c) ==
    LET t == coord[c].attempt IN
    /\ coord[c].aphase = "flushing" /\ Att(t).required \subseteq Att(t).acks
    /\ coord' = [coord EXCEPT ![c].aphase = Go(AttemptEdges, @, "commit")]
    /\ attempts' = [attempts EXCEPT ![t].cas = "in_flight"]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, owner, rx, inflight, budget>>

\* The control plane executes a compare-and-set: only from the active
\* coordinator, never after the deadline or after the attempt is obsolete.
CompareAndSet(t) ==
    LET a == Att(t)
        reply == IF a.coord # epoch THEN "conflict"
                 ELSE IF a.obsolete \/ a.expired
                      THEN (IF record = NONE THEN "failed" ELSE "conflict")
                 ELSE IF record = NONE THEN "succeeded" ELSE "conflict"
    IN
    /\ a.cas = "in_flight"
    /\ attempts' = [attempts EXCEPT ![t].cas = "done", ![t].reply = reply]
    /\ IF reply = "succeeded"
       THEN record' = t /\ commitEpoch' = epoch
       ELSE UNCHANGED <<record, commitEpoch>>
    /\ UNCHANGED <<epoch, registered, coord, owner, rx, inflight, budget>>

\* The record names (v+1, g) of the attempt (from the reply or read_commit).
CommitSucceeded(c) ==
    LET cv == coord[c]
        t == cv.attempt
    IN
    /\ t # NONE
    /\ \/ /\ \/ (cv.aphase = "committing" /\ Att(t).reply = "succeeded")
             \/ (cv.aphase = "resolving" /\ record = t)
          /\ coord' = [coord EXCEPT ![c].aphase = Go(AttemptEdges, @, "commit_succeeded"),
                                    ![c].tphase = Go(TransitionEdges, @, "commit_succeeded")]
       \/ /\ cv.tphase = "resolving" /\ record = t
          /\ coord' = [coord EXCEPT ![c].tphase = Go(TransitionEdges, @, "commit_succeeded")]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, owner, rx, inflight, budget>>

\* The record still holds K^v and no commit of the attempt can change it.
CommitFailed(c) ==
    LET cv == coord[c]
        t == cv.attempt
    IN
    /\ t # NONE
    /\ \/ /\ \/ (cv.aphase = "committing" /\ Att(t).reply = "failed")
             \/ (cv.aphase = "resolving" /\ record = NONE)
          /\ coord' = [coord EXCEPT ![c].aphase = Go(AttemptEdges, @, "commit_failed"),
                                    ![c].tphase = Go(TransitionEdges, @, "commit_failed"),
                                    ![c].overwrite = TRUE]
       \/ /\ cv.tphase = "resolving" /\ record = NONE
          /\ coord' = [coord EXCEPT ![c].tphase = Go(TransitionEdges, @, "commit_failed"),
                                    ![c].overwrite = TRUE]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, owner, rx, inflight, budget>>

\* No reply: the request is still in flight, or its reply was lost.
CommitUnknown(c) ==
    LET t == coord[c].attempt IN
    /\ coord[c].aphase = "committing"
    /\ Att(t).cas = "in_flight" \/ Att(t).reply = "lost"
    /\ coord' = [coord EXCEPT ![c].aphase = Go(AttemptEdges, @, "commit_unknown")]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, owner, rx, inflight, budget>>

\* Read the record once no commit of the attempt can change it (paper App.
\* B.2: read_commit waits past the deadline); after takeover, once drained.
ReadCommit(c) ==
    LET cv == coord[c]
        t == cv.attempt
    IN
    /\ t # NONE
    /\ \/ /\ cv.aphase = "unknown" /\ (Att(t).expired \/ Att(t).obsolete)
          /\ coord' = [coord EXCEPT ![c].aphase = Go(AttemptEdges, @, "read_commit")]
       \/ /\ cv.tphase = "taking_over" /\ cv.aphase = "stopping" /\ cv.stopped
          /\ coord' = [coord EXCEPT ![c].tphase = Go(TransitionEdges, @, "read_commit")]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, owner, rx, inflight, budget>>

\* The control plane raises conflict: replaced, or another coordinator
\* committed.  The coordinator stands down without touching the gate.
Conflict(c) ==
    LET cv == coord[c]
        t == cv.attempt
        lostRace == t # NONE /\ \/ (cv.aphase = "committing" /\ Att(t).reply = "conflict")
                                \/ (cv.aphase = "resolving" /\ record \notin {NONE, t})
                                \/ (cv.tphase = "resolving" /\ record \notin {NONE, t})
    IN
    /\ cv.started /\ (lostRace \/ epoch # c) /\ Can(TransitionEdges, cv.tphase, "conflict")
    /\ coord' = [coord EXCEPT
          ![c].tphase = Go(TransitionEdges, @, "conflict"),
          ![c].aphase = IF Can(AttemptEdges, @, "conflict")
                        THEN Go(AttemptEdges, @, "conflict") ELSE @]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, owner, rx, inflight, budget>>

(***************************************************************************)
(* Failure and recovery (Algorithm B.2)                                    *)
(***************************************************************************)

FailCoord(cs, c) ==   \* the coordinator's reaction to a failed attempt
    [cs EXCEPT ![c].aphase = Go(AttemptEdges, @, "fail"),
               ![c].tphase = IF @ \in {"admitting", "running"}
                             THEN Go(TransitionEdges, @, "fail") ELSE @,
               ![c].overwrite = IF coord[c].tphase \in {"admitting", "running"}
                                THEN coord[c].admitted ELSE @]

Noticing(r) == {c \in Acting : coord[c].aphase \in AttemptRunning
                               /\ \E q \in Att(coord[c].attempt).required : q[1] = r}

Notice(cs, r) == [c \in Coords |-> IF c \in Noticing(r) THEN FailCoord(cs, c)[c] ELSE cs[c]]

\* An attempt fails: the coordinator gives up waiting (timeout, transport
\* error), or a receiver rejects a payload (digest, schema, conflicting
\* duplicate) and reports it.
Fail(kind, p) ==
    /\ budget.failures > 0
    /\ budget' = [budget EXCEPT !.failures = @ - 1]
    /\ \/ /\ kind = "coordinator" /\ coord[p].aphase \in AttemptRunning
          /\ coord' = FailCoord(coord, p)
          /\ UNCHANGED rx
       \/ /\ kind = "receiver" /\ rx[p].phase \in ReceiverRunning
          /\ rx' = [rx EXCEPT ![p].phase = Go(ReceiverEdges, @, "fail")]
          /\ coord' = Notice(coord, p)
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, owner, inflight>>

\* The control plane refuses the attempt's commit; endpoints ignore its
\* later payloads and open_apply.
MarkObsolete(c) ==
    LET t == coord[c].attempt IN
    /\ coord[c].aphase = "failed"
    /\ coord' = [coord EXCEPT ![c].aphase = Go(AttemptEdges, @, "mark_obsolete")]
    /\ attempts' = [attempts EXCEPT ![t].obsolete = TRUE]
    /\ owner' = [o \in Owners |->
          IF owner[o].attempt = t /\ Can(OwnerEdges, owner[o].phase, "mark_obsolete")
          THEN [owner[o] EXCEPT !.phase = Go(OwnerEdges, @, "mark_obsolete")] ELSE owner[o]]
    /\ rx' = [r \in Receivers |->
          IF r \notin Live(t) THEN rx[r]
          ELSE [rx[r] EXCEPT
                  !.epoch = IF @ < c THEN c ELSE @,
                  !.phase = IF rx[r].attempt = t /\ Can(ReceiverEdges, @, "mark_obsolete")
                            THEN Go(ReceiverEdges, @, "mark_obsolete") ELSE @]]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, inflight, budget>>

\* Surviving endpoints drain the attempt's writes; crashed receivers retire.
StopAndWait(c) ==
    LET t == coord[c].attempt IN
    /\ coord[c].aphase = "obsolete"
    /\ coord' = [coord EXCEPT ![c].aphase = Go(AttemptEdges, @, "stop_and_wait"),
                              ![c].stopped = TRUE]
    /\ owner' = [o \in Owners |->
          IF owner[o].attempt = t /\ owner[o].phase = "obsolete"
          THEN [owner[o] EXCEPT !.phase = Go(OwnerEdges, @, "stop_and_wait")] ELSE owner[o]]
    /\ rx' = [r \in Receivers |->
          IF rx[r].attempt = t /\ rx[r].phase = "obsolete"
          THEN [rx[r] EXCEPT !.phase = Go(ReceiverEdges, @, "stop_and_wait")] ELSE rx[r]]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, inflight, budget>>

CleanEndpoints(t) ==
    /\ owner' = [o \in Owners |->
          IF owner[o].attempt = t /\ owner[o].phase \in {"stopped", "updated"}
          THEN [owner[o] EXCEPT !.phase = Go(OwnerEdges, @, "cleanup")] ELSE owner[o]]
    /\ rx' = [r \in Receivers |->
          IF rx[r].attempt = t /\ rx[r].phase \in {"stopped", "acked"}
          THEN [rx[r] EXCEPT !.phase = Go(ReceiverEdges, @, "cleanup")] ELSE rx[r]]

\* Release the attempt; then retry, end, finish the commit (every owner
\* reported its baseline update) or wait for dense refits (abort).
Cleanup(c) ==
    LET cv == coord[c]
        t == cv.attempt
    IN
    /\ \/ /\ cv.tphase = "finishing" /\ cv.reported = Owners
          /\ coord' = [coord EXCEPT ![c].tphase = Go(TransitionEdges, @, "cleanup"),
                                    ![c].aphase = Go(AttemptEdges, @, "cleanup")]
          /\ CleanEndpoints(t)
       \/ /\ cv.tphase = "aborting" /\ cv.aphase = "cleaned"
          /\ coord' = [coord EXCEPT ![c].tphase = Go(TransitionEdges, @, "cleanup")]
          /\ UNCHANGED <<owner, rx>>
       \/ /\ cv.tphase \in {"readmitting", "recovering", "rejecting", "aborting"}
          /\ cv.aphase = "stopping"
          /\ coord' = [coord EXCEPT
                ![c].tphase = IF @ \in {"rejecting", "aborting"}
                              THEN Go(TransitionEdges, @, "cleanup") ELSE @,
                ![c].aphase = Go(AttemptEdges, @, "cleanup")]
          /\ CleanEndpoints(t)
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, inflight, budget>>

\* An owner reads (v+1, g), updates trackers and residual baseline in place
\* and reports; repeating it after failover is safe (absolute values).
BaselineUpdate(o, c) ==
    /\ coord[c].tphase = "finishing" /\ record # NONE
    /\ o \notin coord[c].reported
    /\ Can(OwnerEdges, owner[o].phase, "baseline_update")
    /\ owner' = [owner EXCEPT ![o].phase = Go(OwnerEdges, @, "baseline_update"),
                              ![o].baseline = V1]
    /\ coord' = [coord EXCEPT ![c].tphase = Go(TransitionEdges, @, "baseline_update"),
                              ![c].reported = @ \cup {o}]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, rx, inflight, budget>>

\* A receiver that acknowledged the committed attempt may reopen as soon as the
\* commit is known, while the owners still update their baselines.
EarlyReopen(r, c) ==
    /\ rx[r].attempt = coord[c].attempt /\ rx[r].phase = "acked"
    /\ rx[r].epoch <= c /\ record # NONE /\ rx[r].acked = record

\* Receivers drop KV caches and reopen the gate: once the commit at a record they
\* acknowledged is known (cleaning up the attempt), at the end of the transition,
\* or after dense refits.  A replaced coordinator's call is ignored by receivers
\* that saw a newer epoch.
ReopenGate(c) ==
    LET cv == coord[c] IN
    \/ /\ cv.tphase = "finishing"
       /\ \E r \in Receivers : EarlyReopen(r, c)
       /\ rx' = [r \in Receivers |->
             IF EarlyReopen(r, c)
             THEN [rx[r] EXCEPT
                     !.phase = Go(ReceiverEdges, Go(ReceiverEdges, @, "cleanup"), "reopen_gate"),
                     !.gateOpen = TRUE, !.kv = EMPTY, !.held = V1]
             ELSE rx[r]]
       /\ UNCHANGED <<coord, record, commitEpoch, epoch, registered, attempts, owner, inflight,
                      budget>>
    \/ /\ cv.tphase = "reopening"
       /\ coord' = [coord EXCEPT ![c].tphase = Go(TransitionEdges, @, "reopen_gate")]
       /\ rx' = [r \in Receivers |->
             IF /\ rx[r].attempt = cv.attempt /\ rx[r].phase = "cleaned"
                /\ rx[r].epoch <= c /\ record # NONE /\ rx[r].acked = record
             THEN [rx[r] EXCEPT !.phase = Go(ReceiverEdges, @, "reopen_gate"),
                                !.gateOpen = TRUE, !.kv = EMPTY, !.held = V1]
             ELSE rx[r]]
       /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, owner, inflight, budget>>
    \/ /\ cv.tphase = "refitting"   \* dirty receivers are dense-refitted first
       /\ \A r \in Receivers : ~(rx[r].phase = "cleaned" /\ Dirty(r))
       /\ coord' = [coord EXCEPT ![c].tphase = Go(TransitionEdges, @, "reopen_gate")]
       /\ rx' = [r \in Receivers |->
             IF /\ rx[r].attempt = cv.attempt /\ rx[r].phase \in {"cleaned", "refitted"}
                /\ rx[r].held = RecordVersion /\ ~Dirty(r) /\ rx[r].epoch <= c
             THEN [rx[r] EXCEPT !.phase = Go(ReceiverEdges, @, "reopen_gate"),
                                !.gateOpen = TRUE, !.kv = EMPTY]
             ELSE rx[r]]
       /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, owner, inflight, budget>>

\* The next coordinator replaces the active one and adopts its last
\* registered attempt, which it treats as admitted (overwrite retries).
TakeOver ==
    LET c == epoch + 1
        adopted == [coord[c] EXCEPT
                      !.started = TRUE,
                      !.tphase = IF registered = NONE THEN @
                                 ELSE Go(TransitionEdges, @, "take_over"),
                      !.aphase = IF registered = NONE THEN @
                                 ELSE Go(AttemptEdges, @, "take_over"),
                      !.attempt = registered,
                      !.overwrite = registered # NONE,
                      !.admitted = registered # NONE]
        old == coord[epoch]
        stoodDown == [old EXCEPT
                        !.tphase = IF Can(TransitionEdges, @, "conflict")
                                   THEN Go(TransitionEdges, @, "conflict") ELSE @,
                        !.aphase = IF Can(AttemptEdges, @, "conflict")
                                   THEN Go(AttemptEdges, @, "conflict") ELSE @]
    IN
    /\ budget.failovers > 0 /\ old.tphase \notin TransitionTerminal
    /\ coord' = [coord EXCEPT ![c] = adopted,
                              ![epoch] = IF ReplacedActs THEN @ ELSE stoodDown]
    /\ epoch' = c
    /\ budget' = [budget EXCEPT !.failovers = @ - 1]
    /\ UNCHANGED <<record, commitEpoch, registered, attempts, owner, rx, inflight>>

\* The operator aborts the transition; never while a commit outcome is
\* pending (the coordinator resolves it first).
Abort(c) ==
    LET cv == coord[c] IN
    /\ budget.aborts > 0 /\ epoch = c /\ Can(TransitionEdges, cv.tphase, "abort")
    /\ cv.aphase \notin {"committing", "unknown", "resolving", "committed"}
    /\ coord' = [coord EXCEPT ![c].tphase = Go(TransitionEdges, @, "abort"),
                              ![c].aphase = IF @ \in AttemptRunning
                                            THEN Go(AttemptEdges, @, "fail") ELSE @]
    /\ budget' = [budget EXCEPT !.aborts = @ - 1]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, owner, rx, inflight>>

\* A receiver restores the committed version by a dense load and prewarm:
\* a new or restarted one, a stale one (the record moved on), or after abort.
DenseRefit(r) ==
    LET refitting == {c \in Acting : coord[c].tphase = "refitting"}
        aborted == rx[r].phase = "cleaned" /\ Dirty(r) /\ refitting # {}
    IN
    /\ \/ rx[r].phase = "joining"
       \/ (rx[r].phase = "refitted" /\ rx[r].held # RecordVersion)
       \/ aborted
    /\ rx' = [rx EXCEPT ![r].phase = Go(ReceiverEdges, @, "dense_refit"),
                        ![r].storage = [x \in Owners |-> RecordVersion],
                        ![r].held = RecordVersion, ![r].kv = EMPTY,
                        ![r].gateOpen = FALSE, ![r].staged = {}, ![r].applied = {},
                        ![r].acked = NONE]
    /\ coord' = IF aborted
                THEN [c \in Coords |-> IF c \in refitting
                        THEN [coord[c] EXCEPT !.tphase = Go(TransitionEdges, @, "dense_refit")]
                        ELSE coord[c]]
                ELSE coord
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, owner, inflight, budget>>

(***************************************************************************)
(* Environment                                                             *)
(***************************************************************************)

\* A receiver process dies; its replacement starts joining with unknown
\* storage.  Its coordinator notices (timeout) and fails the attempt.
CrashReceiver(r) ==
    /\ budget.crashes > 0 /\ rx[r].phase # "joining"
    /\ rx' = [rx EXCEPT ![r] = [phase |-> "joining", attempt |-> NONE, inc |-> @.inc + 1,
                                gateOpen |-> FALSE, kv |-> EMPTY,
                                storage |-> [x \in Owners |-> LOST], staged |-> {},
                                applied |-> {}, held |-> EMPTY, epoch |-> 0,
                                acked |-> NONE]]
    /\ coord' = Notice(coord, r)
    /\ inflight' = {m \in inflight : m.receiver # r}
    /\ budget' = [budget EXCEPT !.crashes = @ - 1]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, attempts, owner>>

LosePayload(m) ==
    /\ budget.losses > 0 /\ m \in inflight
    /\ inflight' = inflight \ {m}
    /\ budget' = [budget EXCEPT !.losses = @ - 1]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, coord, attempts, owner, rx>>

\* The transport delivers an already ingested payload again.
DuplicatePayload(m) ==
    /\ budget.duplicates > 0 /\ m \notin inflight
    /\ rx[m.receiver].attempt = m.attempt /\ rx[m.receiver].phase \in ReceiverRunning
    /\ \/ <<m.range, m.enc>> \in rx[m.receiver].staged
       \/ m.range \in rx[m.receiver].applied /\ m.enc = Enc(m.attempt, m.range)
    /\ inflight' = inflight \cup {m}
    /\ budget' = [budget EXCEPT !.duplicates = @ - 1]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, coord, attempts, owner, rx>>

LoseCommitReply(t) ==
    /\ budget.replyLosses > 0 /\ AwaitsOutcome(t)
    /\ Att(t).reply \in {"succeeded", "failed", "conflict"}
    /\ attempts' = [attempts EXCEPT ![t].reply = "lost"]
    /\ budget' = [budget EXCEPT !.replyLosses = @ - 1]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, coord, owner, rx, inflight>>

\* The commit deadline passes; the control plane accepts no commit of t after.
ExpireDeadline(t) ==
    /\ Att(t).cas # "none" /\ ~Att(t).expired /\ AwaitsOutcome(t)
    /\ attempts' = [attempts EXCEPT ![t].expired = TRUE]
    /\ UNCHANGED <<record, commitEpoch, epoch, registered, coord, owner, rx, inflight, budget>>

Payloads == [attempt : 1 .. MaxAttempts, range : Owners, receiver : Receivers,
             enc : {XOR_V0, XOR_V1, OVERWRITE}]

Next ==
    \/ \E c \in Acting : \/ Prepare(c) \/ Reject(c) \/ Send("coordinator", c)
                         \/ WaitForRequests(c) \/ OpenApply(c) \/ Flush(c) \/ Commit(c)
                         \/ CommitSucceeded(c) \/ CommitFailed(c) \/ CommitUnknown(c)
                         \/ ReadCommit(c) \/ Fail("coordinator", c) \/ MarkObsolete(c)
                         \/ StopAndWait(c) \/ Cleanup(c) \/ ReopenGate(c) \/ Abort(c)
    \/ \E c \in Coords : Conflict(c)
    \/ \E o \in Owners : Send("owner", o)
    \/ \E r \in Receivers : Fail("receiver", r)
    \/ \E o \in Owners, c \in Acting : BaselineUpdate(o, c)
    \/ \E r \in Receivers : Apply(r) \/ Ack(r) \/ DenseRefit(r) \/ CrashReceiver(r)
    \/ \E m \in inflight : Ingest(m) \/ LosePayload(m)
    \/ \E m \in Payloads : DuplicatePayload(m)
    \/ \E t \in 1 .. NumAttempts : CompareAndSet(t) \/ LoseCommitReply(t) \/ ExpireDeadline(t)
    \/ TakeOver

Spec == Init /\ [][Next]_vars

(***************************************************************************)
(* Invariants (dcr/testing/spec/invariants.py, same names)                 *)
(***************************************************************************)

\* A commit happens only after every required receiver ACKed that attempt.
CommitRequiresAllAcks == record # NONE => Att(record).required \subseteq Att(record).acks

\* Every receiver that holds a committed version holds exactly it.
CommittedReceiversExact ==
    /\ record # NONE =>
         \A q \in Att(record).required :
            rx[q[1]].inc = q[2] => \A x \in Owners : rx[q[1]].storage[x] = V1
    /\ \A r \in Receivers :
         rx[r].phase \in {"ready", "refitted"} =>
            \A x \in Owners : rx[r].storage[x] = rx[r].held

\* Owners update the baseline only after the commit and before the transition
\* ends, so the next delta starts from the committed version.  (Gates may reopen
\* earlier: receivers serve the committed record, which baselines do not change.)
BaselineMatchesCommit ==
    /\ \A o \in Owners : owner[o].baseline = V1 => record # NONE
    /\ (\E c \in Coords : coord[c].tphase \in {"reopening", "committed"})
       => \A o \in Owners : owner[o].baseline = RecordVersion

\* An XOR entry is applied at most once, and only to its own base.
XorAppliedOnce == \A r \in Receivers, x \in Owners : rx[r].storage[x] # BAD

\* Only the active coordinator's commit changes the record.
ReplacedNeverCommits == record # NONE => commitEpoch = Att(record).coord

\* An open gate serves exactly the committed version, with a KV cache of it.
GateClosedOnMixture ==
    \A r \in Receivers : rx[r].gateOpen =>
        /\ \A x \in Owners : rx[r].storage[x] = RecordVersion
        /\ rx[r].kv \in {EMPTY, RecordVersion}

=============================================================================
