-- xpud ledger schema v8, written by xpud 0.1.0 (commit 5ceab6e) on the simulated
-- workstation-2x; made by tests/data/make_ledger_fixture.py. Load with sqlite3's executescript.
PRAGMA user_version=8;
BEGIN TRANSACTION;
CREATE TABLE auto_leases (
        lease_id TEXT PRIMARY KEY,
        job_class TEXT NOT NULL,
        auto INTEGER NOT NULL,        
        moves INTEGER NOT NULL DEFAULT 0,
        last_move REAL,               
        last_direction TEXT NOT NULL DEFAULT ''
    );
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
INSERT INTO "events" VALUES(1,1.79663470978189563753e+09,'mode',0,'','card 0 switched to sliced for lease 34cb4ce0: a vxpu-half request found no room on a sliced card');
INSERT INTO "events" VALUES(2,1.79663470978191828729e+09,'grant',0,'34cb4ce0','lease 34cb4ce0 (vxpu-half) on card 0 to uid 0');
INSERT INTO "events" VALUES(3,1.79663470979479455947e+09,'grant',0,'ab6fe0d6','lease ab6fe0d6 (vxpu-quarter) on card 0 to uid 0');
INSERT INTO "events" VALUES(4,1.79663470979932332043e+09,'grant',1,'d48edda7','lease d48edda7 (xpu) on card 1 to uid 0');
INSERT INTO "events" VALUES(5,1.79663470980367588995e+09,'release',0,'ab6fe0d6','lease ab6fe0d6 released: released by uid 0 (its command exited 3)');
INSERT INTO "events" VALUES(6,1.79663470981130146981e+09,'drain',1,'','card 1 drained: fixture: drained before the upgrade');
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
    , started REAL, exit_code INTEGER, exit_signal INTEGER, name TEXT NOT NULL DEFAULT '', anchor TEXT NOT NULL DEFAULT '');
INSERT INTO "leases" VALUES('34cb4ce0','734607be7bb29a442a0eccc150c4bf498fefe2b4c5c942e3a6e33519b452f7cd','vxpu-half',0,'[0]','["GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead"]','[{"card_index": 0, "size": "vxpu-half", "memory_bytes": 25226641408, "compute_pct": 30, "handle": "mps:0:34cb4ce0", "placement": null}]','{"CUDA_VISIBLE_DEVICES": "GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=24058M", "XPU_MEMORY_LIMIT_BYTES": "25226641408", "XPU_COMPUTE_PCT": "30", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/xpu-fix-x_xzg09f/run/mps/0/pipe", "XPU_LEASE_ID": "34cb4ce0", "XPU_MODE": "vxpu-half", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,7087,'python serve.py',1.79663470978168272971e+09,'active',NULL,'',0,'',NULL,NULL,NULL,'','');
INSERT INTO "leases" VALUES('ab6fe0d6','c96f3724a09dc69650a68543f7b112dc2bdadc64a93ef078f5926a444d4c019e','vxpu-quarter',0,'[0]','["GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead"]','[{"card_index": 0, "size": "vxpu-quarter", "memory_bytes": 12613320704, "compute_pct": 15, "handle": "mps:0:ab6fe0d6", "placement": null}]','{"CUDA_VISIBLE_DEVICES": "GPU-20372a56-a7c8-54ca-9630-6550ac8a1ead", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "15", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=12029M", "XPU_MEMORY_LIMIT_BYTES": "12613320704", "XPU_COMPUTE_PCT": "15", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/xpu-fix-x_xzg09f/run/mps/0/pipe", "XPU_LEASE_ID": "ab6fe0d6", "XPU_MODE": "vxpu-quarter", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,7087,'python infer.py',1.796634709794667244e+09,'released',1.79663470980366420746e+09,'released by uid 0',0,'',1.796634709794667244e+09,3,NULL,'','');
INSERT INTO "leases" VALUES('d48edda7','12bf95b66db6578c38526570f81ca2ef159d9bc8e1fd2cabd9fbc787b3a59643','xpu',0,'[1]','["GPU-534a60eb-8afd-55d0-a311-8906dc696a01"]','[]','{"CUDA_VISIBLE_DEVICES": "GPU-534a60eb-8afd-55d0-a311-8906dc696a01", "XPU_LEASE_ID": "d48edda7", "XPU_MODE": "xpu", "XPU_RESTART_COUNT": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}',0,0,7087,'python train.py',1.79663470979922127723e+09,'active',NULL,'',0,'',NULL,NULL,NULL,'','');
CREATE TABLE mig_made (
        card_uuid TEXT NOT NULL,
        start INTEGER NOT NULL,       
        profile_id INTEGER NOT NULL,  
        device_uuid TEXT NOT NULL DEFAULT '',  
        created REAL NOT NULL,
        PRIMARY KEY (card_uuid, start)
    );
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
CREATE TABLE standby (
        handle TEXT PRIMARY KEY,      
        card_uuid TEXT NOT NULL,
        size TEXT NOT NULL,
        slice TEXT NOT NULL,          
        created REAL NOT NULL
    );
CREATE TABLE usage_readings (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job_class TEXT NOT NULL,
        ts REAL NOT NULL,             
        sm_pct REAL,                  
        membw_pct REAL,
        mem_bytes INTEGER,
        cap_pct REAL NOT NULL,
        mem_cap_bytes INTEGER NOT NULL
    );
CREATE INDEX leases_by_state ON leases(state);
CREATE INDEX health_changes_by_card ON health_changes(card_uuid, id);
CREATE INDEX reservations_by_state ON reservations(state);
CREATE INDEX events_by_lease ON events(lease_id, id);
CREATE INDEX events_by_card ON events(card, id);
CREATE INDEX usage_readings_by_class ON usage_readings(job_class, id);
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('events',6);
COMMIT;
