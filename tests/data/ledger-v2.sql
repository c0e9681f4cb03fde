-- xpud ledger schema v2, written by xpud 0.1.0 (commit e864faf) on the simulated
-- workstation-2x; made by tests/data/make_ledger_fixture.py. Load with sqlite3's executescript.
PRAGMA user_version=2;
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
INSERT INTO "events" VALUES(1,1.79623403028499221802e+09,'mode',0,'','card 0 switched to sliced for lease a8d64c3e');
INSERT INTO "events" VALUES(2,1.79623403028762435905e+09,'grant',0,'a8d64c3e','lease a8d64c3e (vxpu-half) on card 0 to uid 0');
INSERT INTO "events" VALUES(3,1.79623403029688978194e+09,'grant',0,'fdb76704','lease fdb76704 (vxpu-quarter) on card 0 to uid 0');
INSERT INTO "events" VALUES(4,1.79623403030174517633e+09,'grant',1,'4f856a5b','lease 4f856a5b (xpu) on card 1 to uid 0');
INSERT INTO "events" VALUES(5,1.79623403031009364126e+09,'release',0,'fdb76704','lease fdb76704 released: released by uid 0');
INSERT INTO "events" VALUES(6,1.7962340303174474239e+09,'drain',1,'','card 1 drained: fixture: drained before the upgrade');
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
    );
INSERT INTO "leases" VALUES('a8d64c3e','e0e0b0faf54d2ae8d17660145ad7276618976a432dd5254dff94a51dedd87458','vxpu-half',0,'[0]','["GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead"]','[{"card_index": 0, "size": "vxpu-half", "memory_bytes": 25226641408, "compute_pct": 30, "handle": "mps:0:a8d64c3e", "placement": null}]','{"CUDA_VISIBLE_DEVICES": "GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/xpu-fix-nhb64lpb/run/mps/0/pipe", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=24058M", "XPU_MEMORY_LIMIT_BYTES": "25226641408", "XPU_COMPUTE_PCT": "30", "XPU_LEASE_ID": "a8d64c3e", "XPU_MODE": "vxpu-half", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,18875,'python serve.py',1.79623403027818441396e+09,'active',NULL,'',0,'');
INSERT INTO "leases" VALUES('fdb76704','b2d59beced7553204c88383193ea906469765742dd3def0fab549a32ef1a4b70','vxpu-quarter',0,'[0]','["GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead"]','[{"card_index": 0, "size": "vxpu-quarter", "memory_bytes": 12613320704, "compute_pct": 15, "handle": "mps:0:fdb76704", "placement": null}]','{"CUDA_VISIBLE_DEVICES": "GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/xpu-fix-nhb64lpb/run/mps/0/pipe", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "15", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=12029M", "XPU_MEMORY_LIMIT_BYTES": "12613320704", "XPU_COMPUTE_PCT": "15", "XPU_LEASE_ID": "fdb76704", "XPU_MODE": "vxpu-quarter", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,18875,'python infer.py',1.79623403029329824446e+09,'released',1.7962340303096258641e+09,'released by uid 0',0,'');
INSERT INTO "leases" VALUES('4f856a5b','1465f04988812be5070826cdcd9c4c706fb418d93397daeb86a075facf1145db','xpu',0,'[1]','["GPU-534a60eb-8afd-55d0-a311-8906dc696a01"]','[]','{"CUDA_VISIBLE_DEVICES": "GPU-534a60eb-8afd-55d0-a311-8906dc696a01", "XPU_LEASE_ID": "4f856a5b", "XPU_MODE": "xpu", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,18875,'python train.py',1.79623403030127930636e+09,'active',NULL,'',0,'');
CREATE INDEX leases_by_state ON leases(state);
CREATE INDEX health_changes_by_card ON health_changes(card_uuid, id);
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('events',6);
COMMIT;
