----------------------------- MODULE membership -----------------------------
(***************************************************************************)
(* Membership between transitions (NeMo-DCR paper App. B.2, joining        *)
(* receivers and failover): a run of several transitions v -> v+1 -> ...  *)
(* during which receivers join, restart and are restored by dense refit,   *)
(* and the coordinator may be replaced by one of a newer epoch.            *)
(*                                                                         *)
(* One transition's internals are abstract here (refit.tla checks them):   *)
(* an attempt binds the receiver processes that accept its prepare, each   *)
(* applies its payloads in one step, then the commit, the owners' baseline *)
(* updates and the gate reopening follow.  Explicit are the receivers'     *)
(* status reports, the active coordinator's membership core (a mirror of   *)
(* dcr.protocol.membership.MembershipCore), dense-refit jobs and their ids *)
(* (dcr.protocol.types.EpochIds), restarts with new incarnations and       *)
(* takeovers.  The sample proof is assumed to miss; only the fingerprint   *)
(* catches a receiver whose bits are not the base.                         *)
(*                                                                         *)
(* dcr/testing/spec/membership/ mirrors this module in Python (one         *)
(* function per action, same names in snake case) and checks it           *)
(* exhaustively; tests/model/ keeps the names of the two in step.          *)
(*                                                                         *)
(* Time is abstract: a deadline (join_wait_s, retry_s, dense_timeout_s,    *)
(* settle_s) may pass between any two steps, within the budgets below.     *)
(* Reductions that lose no behaviour of interest: the owners' status       *)
(* reports reach the core at once (the prepare itself waits for their      *)
(* candidates); the owners handle a dense call in the step that issues it  *)
(* (they send, or refuse when their baseline is not its record); a         *)
(* replaced coordinator stands down at the takeover (its calls stay in     *)
(* flight); one process's reports arrive in order.  The Python mirror      *)
(* also forgets sent payloads no call or job refers to, stores receivers   *)
(* in a canonical order and raises each receiver's seen epoch to the       *)
(* smallest epoch in play above it: states that behave alike, stored once. *)
(***************************************************************************)
EXTENDS Naturals, Integers, FiniteSets, Sequences, TLC

CONSTANTS
    NumOwners, NumReceivers,
    Transitions,    \* versions 0 .. Transitions
    Restarts,       \* receiver processes that start again empty
    Checkpoints,    \* ... from the committed version's checkpoint
    Foreign,        \* ... claiming the record from a checkpoint that is not it
    OwnerRestarts, Takeovers,
    DenseFailures,  \* dense jobs whose payloads land only in part
    Timeouts,       \* dense jobs sent again at their deadline
    Retries,        \* dense jobs sent again after a reported failure
    SettleTimeouts, \* settling periods that end at settle_s
    JoinWaits,      \* transitions that start without a joiner (join_wait_s)
    FingerprintOnJoin,
    ReopenWhileRestoring, \* a restored receiver reopens while a newer dense job of
                          \* another record runs (TRUE: today's receiver core)
    VerifyRestarted,      \* TransitionDone verifies members restarted after the
                          \* fingerprinting prepare (TRUE: today's membership core)
    EarlyRetire     \* a restart before the run's first prepare takes the
                    \* receiver out of the run (FALSE: today's fleet)

Owners == 0 .. (NumOwners - 1)
Receivers == 0 .. (NumReceivers - 1)
NOTHING == -1   \* no committed record held
LOST == -2      \* an empty process, or a checkpoint that is not what it claims
BAD == -3       \* an XOR entry landed on bits other than its base
MIXED == -4     \* part of a dense job's payloads landed
NoJob == [job |-> 0, record |-> NOTHING, failed |-> FALSE]
NoStatus == [inc |-> -1, record |-> NOTHING]
AttemptId(e, n) == e * 2^32 + n          \* EpochIds(e).attempts()
JobId(e, n) == e * 2^32 + 2^31 + n       \* EpochIds(e).dense_job(), n >= 1
EpochOf(id) == id \div 2^32

VARIABLES
    record,       \* the committed version
    lease,        \* the active coordinator epoch
    registered,   \* last registered attempt: [epoch, attempt, base, receivers]
    core,         \* [epoch, issued, status, unverified, restarted, jobs,
                  \*  engaged, settling] of the active coordinator
    run,          \* the running transition, or <<>>
    owner,        \* owner -> [inc, baseline, staged]
    rx,           \* receiver -> [phase, inc, storage, held, dirty, gate, seen,
                  \*              dense, acked, foreign]
    toReceivers,  \* DenseRefit calls in flight: [job, receiver, record, epoch]
    sent,         \* <<job, record>> whose payloads every owner sent
    reopens,      \* ReopenGate calls in flight: [job, receiver, record, epoch]
    readies,      \* ReceiverReady in flight: [receiver, inc, job, record]
    staleEpoch,   \* newest epoch a replaced coordinator issued jobs under
    commits,      \* history: [epoch, lease, missing] per commit
    budget

vars == <<record, lease, registered, core, run, owner, rx, toReceivers, sent,
          reopens, readies, staleEpoch, commits, budget>>

(***************************************************************************)
(* The receivers' lifecycle edges used here (refit.tla, generated table).  *)
(***************************************************************************)
CanPrepare(p) == p \in {"ready", "refitted", "cleaned"}
CanDense(p) == p \in {"joining", "ready", "refitted", "cleaned"}
CanReopen(p) == p \in {"refitted", "cleaned"}

Running == run # <<>>

\* The attempt ends without a commit: its receivers stop and clean up (writes
\* that landed stay: the receiver is dirty).
StopBound(x) == IF \E q \in run.bound : q[1] = x /\ rx[x].inc = q[2]
                   /\ rx[x].phase \in {"prepared", "acked"}
                THEN [rx[x] EXCEPT !.phase = "cleaned", !.acked = NOTHING] ELSE rx[x]
FreshCore(e) == [epoch |-> e, issued |-> 0, status |-> [r \in Receivers |-> NoStatus],
                 unverified |-> {}, restarted |-> {},
                 jobs |-> [r \in Receivers |-> NoJob], engaged |-> {},
                 settling |-> NOTHING]

Init ==
    /\ record = 0 /\ lease = 1 /\ registered = <<>> /\ core = FreshCore(1)
    /\ run = <<>>
    /\ owner = [o \in Owners |-> [inc |-> 0, baseline |-> 0, staged |-> FALSE]]
    /\ rx = [r \in Receivers |-> [phase |-> "ready", inc |-> 0, storage |-> 0, held |-> 0,
                                  dirty |-> FALSE, gate |-> TRUE, seen |-> 0,
                                  dense |-> NoJob, acked |-> NOTHING, foreign |-> FALSE]]
    /\ toReceivers = {} /\ sent = {} /\ reopens = {} /\ readies = {}
    /\ staleEpoch = 0 /\ commits = <<>>
    /\ budget = [restarts |-> Restarts, checkpoints |-> Checkpoints, foreign |-> Foreign,
                 ownerRestarts |-> OwnerRestarts, takeovers |-> Takeovers,
                 denseFailures |-> DenseFailures, timeouts |-> Timeouts,
                 retries |-> Retries, settleTimeouts |-> SettleTimeouts,
                 joinWaits |-> JoinWaits]

(***************************************************************************)
(* The membership core (MembershipCore)                                    *)
(***************************************************************************)

\* _start_job: a fresh job of the core's epoch replaces the receiver's one;
\* the owners send at once, or refuse (their baseline is not the record).
StartJob(c, r, v) ==
    LET n == c.issued + 1
        j == JobId(c.epoch, n)
        ok == \A o \in Owners : owner[o].baseline = v
    IN [core |-> [c EXCEPT !.issued = n,
                           !.jobs[r] = [job |-> j, record |-> v, failed |-> ~ok]],
        call |-> [job |-> j, receiver |-> r, record |-> v, epoch |-> lease],
        sent |-> IF ok THEN {<<j, v>>} ELSE {}]

StartJobs(c, rs, v) ==   \* DenseAsked for every receiver of rs (in any order)
    LET F[S \in SUBSET rs] ==
            IF S = {} THEN [core |-> c, calls |-> {}, sent |-> {}]
            ELSE LET r == CHOOSE x \in S : \A y \in S : x <= y
                     prev == F[S \ {r}]
                     one == StartJob(prev.core, r, v)
                 IN [core |-> one.core, calls |-> prev.calls \cup {one.call},
                     sent |-> prev.sent \cup one.sent]
    IN F[rs]

\* A process's status report reaches the core (its ReceiverReady first).
Report(r) ==
    LET now == [inc |-> rx[r].inc, record |-> rx[r].held]
        before == core.status[r]
        restart == before # NoStatus /\ before.inc # now.inc
        c1 == [core EXCEPT !.status[r] = now,
                           !.unverified = IF before = NoStatus \/ restart
                                          THEN @ \cup {r} ELSE @,
                           !.restarted = IF restart THEN @ \cup {r} ELSE @,
                           !.jobs[r] = IF restart THEN NoJob ELSE @]
        retire == restart /\ Running /\ ~run.committed /\ (run.tries > 0 \/ EarlyRetire)
        failing == retire /\ run.attempt # 0 /\ \E q \in run.bound : q[1] = r
    IN
    /\ before # now
    /\ ~\E m \in readies : m.receiver = r /\ m.inc = rx[r].inc
    /\ core' = c1
    /\ run' = IF ~retire THEN run
              ELSE IF failing
                   THEN [run EXCEPT !.members = @ \ {r}, !.attempt = 0, !.bound = {},
                                    !.applied = {}, !.overwrite = TRUE]
                   ELSE [run EXCEPT !.members = @ \ {r}]
    /\ rx' = IF failing THEN [x \in Receivers |-> StopBound(x)] ELSE rx
    /\ UNCHANGED <<record, lease, registered, owner, toReceivers, sent, reopens, readies,
                   staleEpoch, commits, budget>>

\* A ReceiverReady reaches the core (it names the job, not the process); a
\* report of a job the core no longer runs is ignored.
Ready(m) ==
    LET r == m.receiver
        j == core.jobs[r]
        current == j # NoJob /\ j.job = m.job
        restored == current /\ j.record = m.record
    IN
    /\ m \in readies
    /\ readies' = readies \ {m}
    /\ core' = IF ~current THEN core
              ELSE [core EXCEPT !.unverified = @ \cup {r},
                                !.status[r] = IF @ = NoStatus THEN @
                                              ELSE [@ EXCEPT !.record = m.record],
                                !.jobs[r] = IF restored THEN NoJob ELSE @]
    /\ reopens' = IF restored
                  THEN reopens \cup {[job |-> j.job, receiver |-> r, record |-> m.record,
                                      epoch |-> lease]}
                  ELSE reopens
    /\ UNCHANGED <<record, lease, registered, run, owner, rx, toReceivers, sent,
                   staleEpoch, commits, budget>>

\* The tick's _refit_joiners for one receiver.
Refit(r) ==
    LET st == core.status[r]
        j == core.jobs[r]
        new == StartJob(core, r, record)
        issue(b) == /\ core' = new.core /\ budget' = b
                    /\ toReceivers' = toReceivers \cup {new.call}
                    /\ sent' = sent \cup new.sent
    IN
    /\ st # NoStatus
    /\ \/ /\ st.record = record /\ j # NoJob        \* it holds the record: release
          /\ core' = [core EXCEPT !.jobs[r] = NoJob]
          /\ UNCHANGED <<toReceivers, sent, budget>>
       \/ /\ st.record # record
          /\ ~(r \in core.engaged /\ (j = NoJob \/ j.record # record))
          /\ \/ (j = NoJob \/ j.record # record) /\ issue(budget)
             \/ /\ j # NoJob /\ j.record = record /\ j.failed /\ budget.retries > 0
                /\ issue([budget EXCEPT !.retries = @ - 1])
             \/ /\ j # NoJob /\ j.record = record /\ ~j.failed /\ budget.timeouts > 0
                /\ issue([budget EXCEPT !.timeouts = @ - 1])
    /\ UNCHANGED <<record, lease, registered, run, owner, rx, reopens, readies,
                   staleEpoch, commits>>

Settled == \A r \in core.engaged :
              /\ core.status[r] # NoStatus
              /\ \/ core.status[r].record \in {core.settling, NOTHING}
                 \/ r \in core.restarted

\* Settling ends: the members reported, or settle_s passed.
Settle ==
    /\ core.settling # NOTHING
    /\ core' = [core EXCEPT !.settling = NOTHING, !.engaged = {}]
    /\ \/ Settled /\ UNCHANGED budget
       \/ ~Settled /\ budget.settleTimeouts > 0
          /\ budget' = [budget EXCEPT !.settleTimeouts = @ - 1]
    /\ UNCHANGED <<record, lease, registered, run, owner, rx, toReceivers, sent, reopens,
                   readies, staleEpoch, commits>>

OwnersStaged == \A o \in Owners : owner[o].baseline = record /\ owner[o].staged

\* _unfinished: a replaced coordinator's attempt that is not finished.
Unfinished ==
    /\ registered # <<>> /\ registered.epoch < core.epoch
    /\ \/ record = registered.base /\ \A o \in Owners : owner[o].staged
       \/ record = registered.base + 1 /\ \E o \in Owners : owner[o].baseline = registered.base

\* The tick starts a transition; its run claims a new epoch.
RunTransition ==
    LET old == Unfinished
        base == IF old THEN registered.base ELSE record
        members == {r \in Receivers : core.status[r] # NoStatus
                                      /\ core.status[r].record = base}
        joining == \E r \in Receivers : core.status[r] = NoStatus
                                        \/ core.status[r].record # record
        fp == FingerprintOnJoin /\ core.unverified \cap members # {}
    IN
    /\ ~Running /\ core.settling = NOTHING
    /\ old \/ OwnersStaged
    /\ IF ~old /\ joining
       THEN budget.joinWaits > 0 /\ budget' = [budget EXCEPT !.joinWaits = @ - 1]
       ELSE UNCHANGED budget
    /\ lease' = lease + 1
    /\ core' = [core EXCEPT !.engaged = members, !.restarted = {}]
    /\ run' = [base |-> base, required |-> members,
               members |-> IF old THEN registered.receivers ELSE members,
               fingerprint |-> fp, proving |-> fp /\ ~old, takeOver |-> old,
               epoch |-> lease + 1, attempt |-> 0, tries |-> 0, overwrite |-> old,
               bound |-> {}, applied |-> {}, committed |-> old /\ record = base + 1,
               reported |-> {}, disproved |-> {}, judged |-> FALSE]
    /\ UNCHANGED <<record, registered, owner, rx, toReceivers, sent, reopens, readies,
                   staleEpoch, commits>>

(***************************************************************************)
(* One transition, abstractly                                              *)
(***************************************************************************)

Accepts(r, e, overwrite, base) ==
    /\ rx[r].seen <= e /\ rx[r].dense = NoJob /\ rx[r].held = base
    /\ overwrite \/ ~rx[r].dirty

\* Register and prepare an attempt; judge a fingerprinting prepare's proofs.
\* A receiver of a replaced coordinator's attempt is stopped first.
Prepare ==
    LET e == run.epoch
        tau == AttemptId(e, run.tries)
        cleaned(r) == r \in run.members /\ rx[r].phase \in {"prepared", "acked"}
                      /\ rx[r].seen < e
        phase(r) == IF cleaned(r) THEN "cleaned" ELSE rx[r].phase
        bound == {<<r, rx[r].inc>> : r \in {x \in run.members :
                      CanPrepare(phase(x)) /\ Accepts(x, e, run.overwrite, run.base)}}
        boundR == {q[1] : q \in bound}
        members == {r \in run.members : r \in boundR}
        disproved == IF run.proving THEN {r \in boundR : rx[r].storage # run.base} ELSE {}
        jobs == StartJobs(core, disproved, run.base)
    IN
    /\ Running /\ ~run.committed /\ run.attempt = 0
    /\ lease = e /\ record = run.base
    /\ \A o \in Owners : owner[o].staged /\ owner[o].baseline = run.base
    /\ \A r \in run.members :   \* the answering process said hello first
          core.status[r] # NoStatus /\ core.status[r].inc = rx[r].inc
    /\ registered' = [epoch |-> e, attempt |-> tau, base |-> run.base, receivers |-> members]
    /\ IF disproved # {}
       THEN \* the attempt fails before admission; the disproved are restored
            /\ rx' = [r \in Receivers |->
                        IF r \in disproved
                        THEN [rx[r] EXCEPT !.phase = "cleaned", !.held = NOTHING,
                                           !.gate = FALSE, !.seen = e]
                        ELSE IF r \in boundR THEN [rx[r] EXCEPT !.phase = "cleaned", !.seen = e]
                        ELSE IF cleaned(r) THEN [rx[r] EXCEPT !.phase = "cleaned",
                                                              !.acked = NOTHING]
                        ELSE rx[r]]
            /\ core' = jobs.core
            /\ toReceivers' = toReceivers \cup jobs.calls
            /\ sent' = sent \cup jobs.sent
            /\ run' = [run EXCEPT !.members = members \ disproved, !.proving = FALSE,
                                  !.disproved = disproved, !.judged = TRUE,
                                  !.tries = @ + 1]
       ELSE \* admitted: the gates close
            /\ rx' = [r \in Receivers |->
                        IF r \in boundR
                        THEN [rx[r] EXCEPT !.phase = "prepared", !.seen = e, !.gate = FALSE]
                        ELSE IF cleaned(r) THEN [rx[r] EXCEPT !.phase = "cleaned",
                                                              !.acked = NOTHING]
                        ELSE rx[r]]
            /\ run' = [run EXCEPT !.members = members, !.proving = FALSE,
                                  !.disproved = IF run.proving THEN {} ELSE @,
                                  !.judged = @ \/ run.proving,
                                  !.tries = @ + 1, !.attempt = tau, !.bound = bound,
                                  !.applied = {}]
            /\ UNCHANGED <<core, toReceivers, sent>>
    /\ UNCHANGED <<record, lease, owner, reopens, readies, staleEpoch, commits, budget>>

\* A bound receiver applies the attempt's payloads and acknowledges; an XOR
\* entry is exact only on its own base.
Apply(r) ==
    /\ Running /\ run.attempt # 0 /\ ~run.committed
    /\ <<r, rx[r].inc>> \in run.bound /\ r \notin run.applied /\ rx[r].phase = "prepared"
    /\ rx' = [rx EXCEPT ![r].phase = "acked", ![r].dirty = TRUE, ![r].acked = run.base + 1,
                        ![r].storage = IF run.overwrite \/ @ = run.base
                                       THEN run.base + 1 ELSE BAD]
    /\ run' = [run EXCEPT !.applied = @ \cup {r}]
    /\ UNCHANGED <<record, lease, registered, core, owner, toReceivers, sent, reopens,
                   readies, staleEpoch, commits, budget>>

\* A bound process is gone: the attempt fails; the retry (overwrite) goes
\* without it.
FailAttempt ==
    LET gone == {q[1] : q \in {p \in run.bound : rx[p[1]].inc # p[2]}} IN
    /\ Running /\ run.attempt # 0 /\ ~run.committed /\ gone # {}
    /\ rx' = [x \in Receivers |-> StopBound(x)]
    /\ run' = [run EXCEPT !.attempt = 0, !.bound = {}, !.applied = {}, !.overwrite = TRUE,
                          !.members = @ \ gone]
    /\ UNCHANGED <<record, lease, registered, core, owner, toReceivers, sent, reopens,
                   readies, staleEpoch, commits, budget>>

\* Every bound process acknowledged: compare-and-set base -> base + 1.
Commit ==
    /\ Running /\ run.attempt # 0 /\ ~run.committed
    /\ \A q \in run.bound : rx[q[1]].inc = q[2] /\ q[1] \in run.applied
    /\ lease = run.epoch /\ record = run.base /\ registered.attempt = run.attempt
    /\ record' = run.base + 1
    /\ run' = [run EXCEPT !.committed = TRUE]
    /\ commits' = Append(commits, [epoch |-> run.epoch, lease |-> lease,
                                   missing |-> {q \in run.bound : q[1] \notin run.applied}])
    /\ UNCHANGED <<lease, registered, core, owner, rx, toReceivers, sent, reopens, readies,
                   staleEpoch, budget>>

\* An owner reads the record and updates its baseline.
BaselineUpdate(o) ==
    /\ Running /\ run.committed /\ o \notin run.reported
    /\ owner' = [owner EXCEPT ![o].baseline = IF @ = run.base THEN record ELSE @,
                              ![o].staged = IF owner[o].baseline = run.base THEN FALSE ELSE @]
    /\ run' = [run EXCEPT !.reported = @ \cup {o}]
    /\ UNCHANGED <<record, lease, registered, core, rx, toReceivers, sent, reopens, readies,
                   staleEpoch, commits, budget>>

\* Every owner updated its baseline: receivers that acknowledged the
\* committed attempt reopen; TransitionDone (verification, settling, ids).
Reopen ==
    /\ Running /\ run.committed /\ run.reported = Owners
    /\ rx' = [r \in Receivers |->
                IF rx[r].phase \in {"acked", "cleaned"} /\ rx[r].acked = record
                   /\ rx[r].seen <= run.epoch
                THEN [rx[r] EXCEPT !.phase = "ready", !.held = record, !.dirty = FALSE,
                                   !.gate = TRUE, !.acked = NOTHING, !.seen = run.epoch]
                ELSE rx[r]]
    /\ core' = [core EXCEPT
                  !.unverified = IF run.fingerprint /\ run.judged
                                 THEN @ \ (run.required \ run.disproved
                                           \ (IF VerifyRestarted THEN {} ELSE core.restarted))
                                 ELSE @,
                  !.settling = record,
                  !.epoch = IF run.epoch > @ THEN run.epoch ELSE @,
                  !.issued = IF run.epoch > core.epoch THEN 0 ELSE @]
    /\ run' = <<>>
    /\ UNCHANGED <<record, lease, registered, owner, toReceivers, sent, reopens, readies,
                   staleEpoch, commits, budget>>

(***************************************************************************)
(* Endpoints: staging, dense refits, gate reopenings                       *)
(***************************************************************************)

Stage(o) ==
    /\ ~owner[o].staged /\ owner[o].baseline < Transitions
    /\ owner' = [owner EXCEPT ![o].staged = TRUE]
    /\ UNCHANGED <<record, lease, registered, core, run, rx, toReceivers, sent, reopens,
                   readies, staleEpoch, commits, budget>>

Failed(c, r, j) == IF c.jobs[r].job = j THEN [c EXCEPT !.jobs[r].failed = TRUE] ELSE c

\* The receiver gets a dense call: starts it where the lifecycle allows a
\* dense refit (a newer job replaces one running), or refuses it (busy).
ReceiveDense(m) ==
    LET r == m.receiver IN
    /\ m \in toReceivers
    /\ toReceivers' = toReceivers \ {m}
    /\ IF m.epoch < rx[r].seen
       THEN UNCHANGED <<rx, core>>    \* the link refuses a replaced coordinator's call
       ELSE IF rx[r].dense # NoJob /\ rx[r].dense.job >= m.job
       THEN rx' = [rx EXCEPT ![r].seen = m.epoch] /\ UNCHANGED core
       ELSE IF CanDense(rx[r].phase) /\ ~(rx[r].phase = "ready" /\ rx[r].held >= m.record)
       THEN /\ rx' = [rx EXCEPT ![r].seen = m.epoch, ![r].gate = FALSE,
                                ![r].dense = [job |-> m.job, record |-> m.record,
                                              failed |-> FALSE]]
            /\ UNCHANGED core
       ELSE rx' = [rx EXCEPT ![r].seen = m.epoch] /\ core' = Failed(core, r, m.job)
    /\ UNCHANGED <<record, lease, registered, run, owner, sent, reopens, readies,
                   staleEpoch, commits, budget>>

\* Every payload of the receiver's job arrived: it holds the job's record.
Restore(r) ==
    LET j == rx[r].dense IN
    /\ j # NoJob /\ <<j.job, j.record>> \in sent
    /\ rx' = [rx EXCEPT ![r].phase = "refitted", ![r].storage = j.record,
                        ![r].held = j.record, ![r].dirty = FALSE, ![r].gate = FALSE,
                        ![r].dense = NoJob, ![r].acked = NOTHING, ![r].foreign = FALSE]
    /\ readies' = readies \cup {[receiver |-> r, inc |-> rx[r].inc, job |-> j.job,
                                  record |-> j.record]}
    /\ UNCHANGED <<record, lease, registered, core, run, owner, toReceivers, sent, reopens,
                   staleEpoch, commits, budget>>

\* A restored receiver's ReopenGate arrives: it serves again if it holds
\* the record exactly.
ReopenGate(m) ==
    LET r == m.receiver
        holds == /\ rx[r].held = m.record /\ ~rx[r].dirty
                 /\ ReopenWhileRestoring \/ rx[r].dense = NoJob
    IN
    /\ m \in reopens
    /\ reopens' = reopens \ {m}
    /\ rx' = IF m.epoch >= rx[r].seen /\ rx[r].phase # "ready"
             THEN [rx EXCEPT ![r].seen = m.epoch,
                             ![r].phase = IF CanReopen(@) /\ holds THEN "ready" ELSE @,
                             ![r].gate = IF CanReopen(rx[r].phase) /\ holds THEN TRUE ELSE @]
             ELSE rx
    /\ UNCHANGED <<record, lease, registered, core, run, owner, toReceivers, sent, readies,
                   staleEpoch, commits, budget>>

(***************************************************************************)
(* Environment                                                             *)
(***************************************************************************)

Fresh(r, phase, storage, held, gate, foreign) ==
    [phase |-> phase, inc |-> rx[r].inc + 1, storage |-> storage, held |-> held,
     dirty |-> FALSE, gate |-> gate, seen |-> 0, dense |-> NoJob, acked |-> NOTHING,
     foreign |-> foreign]

\* A receiver process dies; a new one starts empty, from the committed
\* checkpoint, or claiming the record from a foreign checkpoint (its gate is
\* taken as closed: serving it is outside the protocol).
RestartReceiver(r) ==
    /\ \/ /\ budget.restarts > 0 /\ budget' = [budget EXCEPT !.restarts = @ - 1]
          /\ rx' = [rx EXCEPT ![r] = Fresh(r, "joining", LOST, NOTHING, FALSE, FALSE)]
       \/ /\ budget.checkpoints > 0 /\ budget' = [budget EXCEPT !.checkpoints = @ - 1]
          /\ rx' = [rx EXCEPT ![r] = Fresh(r, "ready", record, record, TRUE, FALSE)]
       \/ /\ budget.foreign > 0 /\ budget' = [budget EXCEPT !.foreign = @ - 1]
          /\ rx' = [rx EXCEPT ![r] = Fresh(r, "ready", LOST, record, FALSE, TRUE)]
    /\ UNCHANGED <<record, lease, registered, core, run, owner, toReceivers, sent, reopens,
                   readies, staleEpoch, commits>>

\* A trainer rank restarts at the committed record; its candidate is gone.
RestartOwner(o) ==
    LET failing == Running /\ run.attempt # 0 /\ ~run.committed IN
    /\ budget.ownerRestarts > 0
    /\ budget' = [budget EXCEPT !.ownerRestarts = @ - 1]
    /\ owner' = [owner EXCEPT ![o] = [inc |-> @.inc + 1, baseline |-> record,
                                      staged |-> FALSE]]
    /\ rx' = IF failing THEN [x \in Receivers |-> StopBound(x)] ELSE rx
    /\ run' = IF failing
              THEN [run EXCEPT !.attempt = 0, !.bound = {}, !.applied = {}, !.overwrite = TRUE]
              ELSE run
    /\ UNCHANGED <<record, lease, registered, core, toReceivers, sent, reopens, readies,
                   staleEpoch, commits>>

\* Part of a dense job's payloads never arrives: the receiver fails the job
\* after the part that landed; the core sends it again.
LoseDense(r) ==
    LET j == rx[r].dense IN
    /\ budget.denseFailures > 0 /\ j # NoJob /\ <<j.job, j.record>> \in sent
    /\ budget' = [budget EXCEPT !.denseFailures = @ - 1]
    /\ rx' = [rx EXCEPT ![r].storage = IF j.record = @ THEN @ ELSE MIXED,
                        ![r].dirty = TRUE, ![r].dense = NoJob]
    /\ core' = Failed(core, r, j.job)
    /\ UNCHANGED <<record, lease, registered, run, owner, toReceivers, sent, reopens,
                   readies, staleEpoch, commits>>

\* A standby claims a newer epoch during a transition: a fresh core; the
\* replaced coordinator stands down, its calls still in flight.
TakeOver ==
    /\ budget.takeovers > 0 /\ Running
    /\ budget' = [budget EXCEPT !.takeovers = @ - 1]
    /\ lease' = lease + 1
    /\ core' = FreshCore(lease + 1)
    /\ run' = <<>>
    /\ staleEpoch' = core.epoch
    /\ UNCHANGED <<record, registered, owner, rx, toReceivers, sent, reopens, readies,
                   commits>>

Next ==
    \/ \E r \in Receivers : Report(r) \/ Refit(r) \/ Apply(r) \/ Restore(r)
                            \/ RestartReceiver(r) \/ LoseDense(r)
    \/ \E m \in readies : Ready(m)
    \/ Settle \/ RunTransition \/ Prepare \/ FailAttempt \/ Commit \/ Reopen
    \/ \E o \in Owners : BaselineUpdate(o) \/ Stage(o) \/ RestartOwner(o)
    \/ \E m \in toReceivers : ReceiveDense(m)
    \/ \E m \in reopens : ReopenGate(m)
    \/ TakeOver

Spec == Init /\ [][Next]_vars

(***************************************************************************)
(* Invariants (dcr/testing/spec/membership/invariants.py, same names)      *)
(***************************************************************************)

\* (a) A receiver process takes part in a mixed-mode attempt only if its
\* storage holds exactly the base record.
MembersHoldBase ==
    Running /\ run.attempt # 0 /\ ~run.overwrite =>
        \A q \in run.bound : rx[q[1]].inc = q[2] /\ q[1] \notin run.applied
                             => rx[q[1]].storage = run.base

\* (b) The active coordinator tracks only jobs it issued: dense ids of its
\* epochs, above every id a replaced coordinator issued.
JobsOfTheActiveCoordinator ==
    \A r \in Receivers : core.jobs[r] # NoJob =>
        LET j == core.jobs[r].job  e == EpochOf(j) IN
        /\ e * 2^32 + 2^31 < j /\ j < (e + 1) * 2^32
        /\ e <= core.epoch /\ e > staleEpoch

XorAppliedOnce == \A r \in Receivers : rx[r].storage # BAD

CommittedReceiversExact ==
    \A r \in Receivers :
        /\ rx[r].phase \in {"ready", "refitted"} /\ ~rx[r].foreign /\ ~rx[r].dirty
           => rx[r].storage = rx[r].held
        /\ rx[r].phase = "acked" => rx[r].storage = rx[r].acked

\* An open gate serves exactly a committed version (an older one while the
\* receiver is behind), and no dense job of another record runs under it.
GateServesCommitted ==
    \A r \in Receivers : rx[r].gate =>
        /\ rx[r].storage = rx[r].held /\ 0 <= rx[r].held /\ rx[r].held <= record
        /\ rx[r].dense = NoJob \/ rx[r].dense.record = rx[r].held

CommitRequiresAllAcks == \A i \in DOMAIN commits : commits[i].missing = {}

ReplacedNeverCommits == \A i \in DOMAIN commits : commits[i].epoch = commits[i].lease

BaselineMatchesCommit ==
    /\ \A o \in Owners : record - 1 <= owner[o].baseline /\ owner[o].baseline <= record
    /\ Running /\ run.attempt # 0 /\ ~run.committed =>
         \A o \in Owners : owner[o].baseline = run.base

=============================================================================
