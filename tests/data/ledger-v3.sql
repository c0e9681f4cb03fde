-- xpud ledger schema v3, written by xpud 0.1.0 (commit b3105e7) on the simulated
-- workstation-2x; made by tests/data/make_ledger_fixture.py. Load with sqlite3's executescript.
PRAGMA user_version=3;
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
INSERT INTO "events" VALUES(1,1.79663192436909556386e+09,'mode',0,'','card 0 switched to sliced for lease 8327099e');
INSERT INTO "events" VALUES(2,1.79663192436940932273e+09,'grant',0,'8327099e','lease 8327099e (vxpu-half) on card 0 to uid 0');
INSERT INTO "events" VALUES(3,1.79663192437710690502e+09,'grant',0,'570cb43d','lease 570cb43d (vxpu-quarter) on card 0 to uid 0');
INSERT INTO "events" VALUES(4,1.79663192438787603375e+09,'grant',1,'a2079546','lease a2079546 (xpu) on card 1 to uid 0');
INSERT INTO "events" VALUES(5,1.79663192439143490786e+09,'release',0,'570cb43d','lease 570cb43d released: released by uid 0');
INSERT INTO "events" VALUES(6,1.7966319243978044987e+09,'drain',1,'','card 1 drained: fixture: drained before the upgrade');
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
INSERT INTO "leases" VALUES('8327099e','731ec4cbcd9b3cac7894109fc48704c14b2822c11d4c5c11063334999fec39a8','vxpu-half',0,'[0]','["GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead"]','[{"card_index": 0, "size": "vxpu-half", "memory_bytes": 25226641408, "compute_pct": 30, "handle": "mps:0:8327099e", "placement": null}]','{"CUDA_VISIBLE_DEVICES": "GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/xpu-fix-cit_d5jg/run/mps/0/pipe", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=24058M", "XPU_MEMORY_LIMIT_BYTES": "25226641408", "XPU_COMPUTE_PCT": "30", "XPU_LEASE_ID": "8327099e", "XPU_MODE": "vxpu-half", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,13919,'python serve.py',1.79663192436798119545e+09,'active',NULL,'',0,'');
INSERT INTO "leases" VALUES('570cb43d','2307caa735276e662a4c1899ba79ab8f3e895b85e1f6b6a9bd37198a045abd62','vxpu-quarter',0,'[0]','["GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead"]','[{"card_index": 0, "size": "vxpu-quarter", "memory_bytes": 12613320704, "compute_pct": 15, "handle": "mps:0:570cb43d", "placement": null}]','{"CUDA_VISIBLE_DEVICES": "GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/xpu-fix-cit_d5jg/run/mps/0/pipe", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "15", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=12029M", "XPU_MEMORY_LIMIT_BYTES": "12613320704", "XPU_COMPUTE_PCT": "15", "XPU_LEASE_ID": "570cb43d", "XPU_MODE": "vxpu-quarter", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,13919,'python infer.py',1.79663192437472367282e+09,'released',1.79663192439080882066e+09,'released by uid 0',0,'');
INSERT INTO "leases" VALUES('a2079546','850535d1ed03e495934b2fe0b3268123d514f0caa6e724cedccece3e2c51a9c9','xpu',0,'[1]','["GPU-534a60eb-8afd-55d0-a311-8906dc696a01"]','[]','{"CUDA_VISIBLE_DEVICES": "GPU-534a60eb-8afd-55d0-a311-8906dc696a01", "XPU_LEASE_ID": "a2079546", "XPU_MODE": "xpu", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,13919,'python train.py',1.79663192438170504564e+09,'active',NULL,'',0,'');
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
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('events',6);
COMMIT;
