-- xpud ledger schema v4, written by xpud 0.1.0 (commit f01a597) on the simulated
-- workstation-2x; made by tests/data/make_ledger_fixture.py. Load with sqlite3's executescript.
PRAGMA user_version=4;
BEGIN TRANSACTION;
CREATE TABLE cards (
        uuid TEXT PRIMARY KEY,
        mode TEXT NOT NULL,
        mode_pinned INTEGER NOT NULL DEFAULT 0,
        drained INTEGER NOT NULL DEFAULT 0,
        drain_reason TEXT NOT NULL DEFAULT ''
    );
INSERT INTO "cards" VALUES('GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead','sliced',0,0,'');
INSERT INTO "cards" VALUES('GPU-534a60eb-8afd-55d0-a311-8906dc696a01','whole',0,1,'fixture: drained before the upgrade');
CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        ts REAL NOT NULL,
        kind TEXT NOT NULL,
        card INTEGER NOT NULL DEFAULT -1,
        lease_id TEXT NOT NULL DEFAULT '',
        message TEXT NOT NULL
    );
INSERT INTO "events" VALUES(1,1.7966319329963097572e+09,'mode',0,'','card 0 switched to sliced for lease 0a8e9bb5: a vxpu-half request found no room on a sliced card');
INSERT INTO "events" VALUES(2,1.79663193299632287028e+09,'grant',0,'0a8e9bb5','lease 0a8e9bb5 (vxpu-half) on card 0 to uid 0');
INSERT INTO "events" VALUES(3,1.79663193299984836571e+09,'grant',0,'fe0a64e5','lease fe0a64e5 (vxpu-quarter) on card 0 to uid 0');
INSERT INTO "events" VALUES(4,1.79663193300566172592e+09,'grant',1,'be16a5ff','lease be16a5ff (xpu) on card 1 to uid 0');
INSERT INTO "events" VALUES(5,1.79663193301250648497e+09,'release',0,'fe0a64e5','lease fe0a64e5 released: released by uid 0 (its command exited 3)');
INSERT INTO "events" VALUES(6,1.79663193302240395549e+09,'drain',1,'','card 1 drained: fixture: drained before the upgrade');
CREATE TABLE health_changes (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        ts REAL NOT NULL,
        card_uuid TEXT NOT NULL,
        card INTEGER NOT NULL,        
        from_state TEXT NOT NULL,
        to_state TEXT NOT NULL,
        score INTEGER NOT NULL,
        reasons TEXT NOT NULL         
    );
CREATE TABLE leases (
        id TEXT PRIMARY KEY,
        token_hash TEXT NOT NULL,
        mode TEXT NOT NULL,
        owner_uid INTEGER NOT NULL,
        cards TEXT NOT NULL,          
        card_uuids TEXT NOT NULL,     
        slices TEXT NOT NULL,         
        env TEXT NOT NULL,            
        priority INTEGER NOT NULL,
        restartable INTEGER NOT NULL,
        holder_pid INTEGER,
        command TEXT NOT NULL,
        created REAL NOT NULL,
        state TEXT NOT NULL,
        ended REAL,
        end_reason TEXT NOT NULL DEFAULT '',
        restart_count INTEGER NOT NULL DEFAULT 0,
        mark TEXT NOT NULL DEFAULT ''
    , started REAL, exit_code INTEGER, exit_signal INTEGER, name TEXT NOT NULL DEFAULT '');
INSERT INTO "leases" VALUES('0a8e9bb5','9a2c3da3fbbfef4eb53be18eacd7ce06e08727e25f51a34f2a7fc0a51ac856e2','vxpu-half',0,'[0]','["GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead"]','[{"card_index": 0, "size": "vxpu-half", "memory_bytes": 25226641408, "compute_pct": 30, "handle": "mps:0:0a8e9bb5", "placement": null}]','{"CUDA_VISIBLE_DEVICES": "GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/xpu-fix-f4jlue_q/run/mps/0/pipe", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=24058M", "XPU_MEMORY_LIMIT_BYTES": "25226641408", "XPU_COMPUTE_PCT": "30", "XPU_LEASE_ID": "0a8e9bb5", "XPU_MODE": "vxpu-half", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,14526,'python serve.py',1.79663193299617099767e+09,'active',NULL,'',0,'',NULL,NULL,NULL,'');
INSERT INTO "leases" VALUES('fe0a64e5','a5bd608605387ae18b76b7a1574d3d80a1546fab7fd72cdd95a9d41a1d52a8dd','vxpu-quarter',0,'[0]','["GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead"]','[{"card_index": 0, "size": "vxpu-quarter", "memory_bytes": 12613320704, "compute_pct": 15, "handle": "mps:0:fe0a64e5", "placement": null}]','{"CUDA_VISIBLE_DEVICES": "GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/xpu-fix-f4jlue_q/run/mps/0/pipe", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "15", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=12029M", "XPU_MEMORY_LIMIT_BYTES": "12613320704", "XPU_COMPUTE_PCT": "15", "XPU_LEASE_ID": "fe0a64e5", "XPU_MODE": "vxpu-quarter", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,14526,'python infer.py',1.79663193299977350233e+09,'released',1.79663193301249837869e+09,'released by uid 0',0,'',1.79663193299977350233e+09,3,NULL,'');
INSERT INTO "leases" VALUES('be16a5ff','d3072ae3101fcc4e69f7d8f5db16874dca87cb58459884cbd3d59371a972d2b5','xpu',0,'[1]','["GPU-534a60eb-8afd-55d0-a311-8906dc696a01"]','[]','{"CUDA_VISIBLE_DEVICES": "GPU-534a60eb-8afd-55d0-a311-8906dc696a01", "XPU_LEASE_ID": "be16a5ff", "XPU_MODE": "xpu", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,14526,'python train.py',1.7966319330046753883e+09,'active',NULL,'',0,'',NULL,NULL,NULL,'');
CREATE TABLE reservations (
        job TEXT PRIMARY KEY,
        attempt INTEGER NOT NULL,
        coordinator TEXT NOT NULL,
        lease_id TEXT NOT NULL,
        cards TEXT NOT NULL,          
        ttl_s REAL NOT NULL,
        created REAL NOT NULL,
        expires REAL NOT NULL,
        state TEXT NOT NULL,          
        ended REAL,
        rank_pid INTEGER NOT NULL DEFAULT 0  
    );
CREATE INDEX leases_by_state ON leases(state);
CREATE INDEX health_changes_by_card ON health_changes(card_uuid, id);
CREATE INDEX reservations_by_state ON reservations(state);
CREATE INDEX events_by_lease ON events(lease_id, id);
CREATE INDEX events_by_card ON events(card, id);
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('events',6);
COMMIT;
